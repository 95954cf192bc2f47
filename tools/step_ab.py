#!/usr/bin/env python
"""Decoding modes side by side, interleaved step by step: the A/B that resolves a few percent per prompt.

Per-prompt alternation (autok_ab.py, `specexport bench`) runs a whole generation of one mode, then of the
next; on a shared 2-core VM the machine's speed drifts over seconds, so its A/A control (target-only against
itself) reads 0.88-0.95 on its worst prompt, and a 0.97 bar per prompt cannot be shown. Here every mode has its
own decoder over its own copy of the engine, all run the same prompt at once, and the next step always goes to
the mode that has committed the fewest tokens (ties in an order that rotates per repetition): the modes cover
the same stretch of wall time, whatever their step sizes, and a slow second hits them all. Each step (one
`Batch.step`) is timed alone; the first token (prefill) is excluded, as in `GenerationStats.decode_rate`.

Checks (stop 46, 2-core AVX2 host): over the Q4_1 engine, four target-only decoders read 0.986-1.004 of the
first per prompt (A/A), where per-prompt alternation reads 0.88-0.95 at its worst; turns of 0.3 s in place of
one step (`--quantum 0.3`) read 0.89-1.06, so the drift that matters is sub-second. Interleaving slows every step
(a step runs after another engine's; fp32 target-only 40-45 tok/s here against 41-53 alone), but not the ratios:
the int8 copy at k = 8 over target-only read 1.701, 1.722, 1.739, 1.653 on four prompts, and 1.706, 1.653, 1.732,
1.730 alternating per prompt (medians of 3). Keep a run to a few modes: with 14 decoders loaded the fp32 step
fell to 29 tok/s.

Modes: `0` (target-only), `auto`, or a built k, each optionally `:DRAFTER` (hybrid, model, prompt-lookup; an
engine built with a draft model). The first mode is the baseline; a repeat of it is the A/A control.

    python tools/step_ab.py engines/smollm2 --modes 0,0,auto --reps 2
    python tools/step_ab.py engines/bench/se-fp32-int8 --modes 0,0,auto:hybrid,2:hybrid,4:hybrid,8:hybrid
    python tools/step_ab.py engines/bench/se-fp32-int8-b16 --clients 16 --modes 0,0,auto --reps 3

With `--clients N` it measures throughput under load instead: each mode runs a closed loop of N clients (a
finished request's row takes the next of `--requests` prompts, EOS ignored, as `bench --clients` does) on a
`Batch` of its own, driven synchronously; a unit of work is the admission of the waiting requests into free rows
plus one step, and the rate is all committed tokens over all units' time. Per repetition each mode's rate over
the baseline's; their geometric mean and range are printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import ab_prompts  # noqa: E402
from specexport.autok import AutoK  # noqa: E402
from specexport.bench.report import geomean  # noqa: E402
from specexport.batch import Batch  # noqa: E402
from specexport.runtime import SpeculativeDecoder  # noqa: E402


class Mode:
    """One decoding mode: its own decoder (engine copy, caches, AutoK) and its runs' measurements."""

    def __init__(self, spec: str, engine: str, opts: dict):
        k, _, drafter = spec.partition(":")
        self.label, self.drafter = spec, drafter  # (the label gains #n when a spec repeats)
        self.k_steps: dict[int, int] = {}  # k run -> steps, over every request of the mode
        self.steps, self.tokens, self.seconds, self.draft_s = 0, 0, 0.0, 0.0  # decode, over every request
        self.speculative = k != "0"
        self.k = "auto" if k == "auto" else int(k)
        self.dec = SpeculativeDecoder.load(engine, **(opts | ({"drafter": drafter} if drafter else {})))
        self.believed: list[float] = []  # auto, tracked: c(K) / c(0) as it believed them after each step
        self.widths: list[int] = []  # auto, tracked: each step's verify width (0: target-only)

    def track(self) -> None:
        """auto: record, after every step, what it believes a verify at its widest k costs over a target-only
        step (to check against the fixed ks' measured steps), and each step's width (a refresh's target-only
        steps, and its check's: AutoK's docstring)."""
        ctl = self.dec.autok()
        observe, K = ctl.observe_costs, max(ctl.ks)

        def tracked(B, j, *args, **kw):
            observe(B, j, *args, **kw)
            c0 = ctl.verify_cost(0, B)
            cK = ctl.verify_cost(K, B) if c0 else None
            if cK:
                self.believed.append(cK / c0)
            self.widths.append(j)
        ctl.observe_costs = tracked

    def batch(self) -> Batch:
        return Batch(self.dec, self.speculative, self.k if self.speculative else 0)


class Stream:
    """One request of one mode, step by step: prefill untimed, then each step timed."""

    def __init__(self, mode: Mode, prompt: str, max_new_tokens: int):
        self.req = mode.dec._prepare([prompt], max_new_tokens, None, True, ())[0]
        self.batch = mode.batch()
        self.batch.admit([0], [self.req])  # prefill and the first token: not decode time
        self.seconds = 0.0

    @property
    def tokens(self) -> int:
        return len(self.req.out)

    @property
    def done(self) -> bool:
        return not self.batch.rows()

    def advance(self) -> None:
        t0 = time.perf_counter()
        self.batch.step()
        self.seconds += time.perf_counter() - t0

    @property
    def rate(self) -> float:
        return (self.tokens - 1) / self.seconds if self.seconds > 0 else 0.0


class Loop:
    """A closed loop of `clients` requests in flight over one mode's Batch; admissions count as work."""

    def __init__(self, mode: Mode, prompts: list[str], clients: int, max_new_tokens: int):
        self.mode, self.clients, self.max_new = mode, clients, max_new_tokens
        self.waiting = list(prompts)
        self.batch = mode.batch()
        self.reqs = []
        self.seconds = 0.0

    @property
    def tokens(self) -> int:
        return sum(len(r.out) for r in self.reqs)

    @property
    def done(self) -> bool:
        return not self.waiting and not self.batch.rows()

    def advance(self) -> None:
        t0 = time.perf_counter()
        free = self.batch.free_rows()[:self.clients - len(self.batch.rows())]
        if free and self.waiting:
            new = [self.mode.dec._prepare([self.waiting.pop(0)], self.max_new, None, True, (), (), True)[0]
                   for _ in free[:len(self.waiting)]]
            self.reqs += new
            self.batch.admit(free[:len(new)], new)
        if self.batch.rows():
            self.batch.step()
        self.seconds += time.perf_counter() - t0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def interleave(runs: list, order: list[int], quantum: float = 0.0) -> None:
    """Give a turn to the run with the fewest committed tokens until all are done (ties: `order`); a turn is
    one step, or steps until the run has spent `quantum` seconds in it."""
    rank = {i: n for n, i in enumerate(order)}
    while True:
        live = [i for i in range(len(runs)) if not runs[i].done]
        if not live:
            return
        run = runs[min(live, key=lambda i: (runs[i].tokens, rank[i]))]
        start = run.seconds
        run.advance()
        while quantum and run.seconds - start < quantum and not run.done:
            run.advance()


def single_stream(a, modes: list[Mode], prompts: list[dict]) -> None:
    res = {}  # prompt id -> {"cat", "same", label -> [ratios]}
    for rep in range(a.reps):
        for n, p in enumerate(prompts):
            order = list(np.roll(np.arange(len(modes)), rep + n))
            runs = [Stream(m, p["prompt"], a.max_new_tokens) for m in modes]
            interleave(runs, order, a.quantum)
            if not runs[0].rate:
                print(f"{p['id']:>14} rep {rep}: skipped (the baseline committed one token: no decode time)")
                continue
            r = res.setdefault(p["id"], {"cat": p.get("category", ""), "same": True} | {m.label: [] for m in modes[1:]})
            for m, run in zip(modes, runs):
                st = run.req.stats
                for k, steps in st.k_steps.items():
                    m.k_steps[k] = m.k_steps.get(k, 0) + steps
                m.steps, m.tokens = m.steps + st.steps, m.tokens + run.tokens - 1
                m.seconds, m.draft_s = m.seconds + run.seconds, m.draft_s + st.draft_s
            for m, run in zip(modes[1:], runs[1:]):
                r[m.label].append(run.rate / runs[0].rate)
                r["same"] &= run.req.out == runs[0].req.out
            print(f"{p['id']:>14} rep {rep}: " + "  ".join(
                f"{m.label} {run.rate / runs[0].rate:.3f}" for m, run in zip(modes[1:], runs[1:]))
                + f"  (baseline {runs[0].rate:.1f} tok/s, {runs[0].tokens} tokens)", flush=True)
    if not res:
        sys.exit("error: no prompt decoded past its first token: raise --max-new-tokens")
    labels = [m.label for m in modes[1:]]
    print("\nper prompt, median over repetitions, over the baseline (" + modes[0].label + "):")
    med = {pid: {lab: float(np.median(r[lab])) for lab in labels} for pid, r in res.items()}
    cats = sorted({r["cat"] for r in res.values()})
    print("| mode | " + " | ".join(cats) + " | all | lowest prompt |")
    print("|---|" + "---|" * (len(cats) + 2))
    for lab in labels:
        cells = [geomean([med[pid][lab] for pid, r in res.items() if r["cat"] == c]) for c in cats]
        lo = min(med, key=lambda pid: med[pid][lab])
        print(f"| {lab} | " + " | ".join(f"{x:.3f}" for x in cells)
              + f" | {geomean([v[lab] for v in med.values()]):.3f} | {med[lo][lab]:.3f} ({lo}) |")
    for m in (m for m in modes[1:] if m.k == "auto"):
        fixed = [f.label for f in modes[1:] if f.speculative and f.k != "auto" and f.drafter == m.drafter]
        if fixed:  # against the fixed ks of its drafter: per prompt (in hindsight), and the best single k
            per = geomean([med[pid][m.label] / max(med[pid][f] for f in fixed) for pid in med])
            best = max(fixed, key=lambda f: geomean([v[f] for v in med.values()]))
            one = geomean([med[pid][m.label] / med[pid][best] for pid in med])
            print(f"{m.label} / the best of {', '.join(fixed)}: per prompt {per:.3f}; the best single k ({best}) "
                  f"{one:.3f}")
        total = sum(m.k_steps.values()) or 1  # verify widths run (a chain cut at a near-tie runs a narrower one)
        print(f"{m.label} steps by verify width: "
              + ", ".join(f"{k}: {n / total:.1%}" for k, n in sorted(m.k_steps.items())))
        ctl = m.dec.autok()
        c0, d = ctl.verify_cost(0, 1), ctl.draft_cost(1, 1)
        if c0:  # what auto believes at the end: costs over c(0), the tie rate, acceptance by source
            tie, seen = ctl.ties
            print("  c(k)/c(0): " + ", ".join(f"{k}: {ctl.verify_cost(k, 1) / c0:.3f}" for k in ctl.ks)
                  + (f"; draft pass {d / c0:.3f}" if d else "") + (f"; ties {tie / seen:.3f}" if seen else "")
                  + "; acceptance " + ", ".join(f"{s}: {ctl.prior(s):.3f}" for s in sorted(ctl.global_acc))
                  + (f"; at a tie {ctl.tie_acceptance():.3f}" if ctl.tie_acc.trials else ""))
        if m.believed:  # over every step: how far what it compared against wandered
            q = np.percentile(m.believed, [0, 10, 50, 90, 100])
            runs = "".join("0" if j == 0 else "x" for j in m.widths).split("x")
            lengths = {n: sum(len(r) == n for r in runs) for n in sorted({len(r) for r in runs if r})}
            print(f"  believed c({max(ctl.ks)})/c(0) after each step: min {q[0]:.3f}, 10% {q[1]:.3f}, median "
                  f"{q[2]:.3f}, 90% {q[3]:.3f}, max {q[4]:.3f}; runs of target-only steps by length: {lengths}")
    base = modes[0]
    if base.steps and not base.speculative:  # what auto's costs are to be checked against, measured
        c0 = base.seconds / base.steps
        print(f"measured per step, over the baseline's step ({c0 * 1e3:.1f} ms): tokens / step, seconds / step "
              "(of which before the verify: drafting, lookup, planning, catch-up)")
        for m in (m for m in modes[1:] if m.speculative and m.steps):
            per = m.seconds / m.steps / c0
            before = m.draft_s / m.steps / c0
            print(f"  {m.label}: {m.tokens / m.steps:.2f} tokens, {per:.3f} ({before:.3f}; the verify and commit "
                  f"{per - before:.3f})")
    same = sum(r["same"] for r in res.values())
    print(f"\nevery mode gave the baseline's tokens on {same}/{len(res)} prompts")


def under_load(a, modes: list[Mode], prompts: list[dict]) -> None:
    n = a.requests or max(32, 6 * a.clients)
    texts = [prompts[i % len(prompts)]["prompt"] for i in range(n)]
    ratios = {m.label: [] for m in modes[1:]}
    for m in modes:  # warm-up at this batch size (AutoK's costs per batch bucket), excluded
        interleave([Loop(m, texts[:2 * a.clients], a.clients, 32)], [0])
    for rep in range(a.reps):
        runs = [Loop(m, texts, a.clients, a.max_new_tokens) for m in modes]
        interleave(runs, list(np.roll(np.arange(len(modes)), rep)), a.quantum)
        if not runs[0].rate:
            sys.exit("error: the baseline committed no tokens under load: raise --max-new-tokens")
        line = []
        for m, run in zip(modes[1:], runs[1:]):
            ratios[m.label].append(run.rate / runs[0].rate)
            same = all(x.out == y.out for x, y in zip(run.reqs, runs[0].reqs))
            line.append(f"{m.label} {run.rate / runs[0].rate:.3f}{'' if same else ' (tokens differ)'}")
        print(f"rep {rep}: " + "  ".join(line) + f"  (baseline {runs[0].rate:.1f} tok/s)", flush=True)
    print(f"\n{a.clients} clients, {n} requests of {a.max_new_tokens} tokens, over the baseline ({modes[0].label}):")
    for lab, xs in ratios.items():
        print(f"  {lab}: {geomean(xs):.3f} (range {min(xs):.3f}-{max(xs):.3f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ab_prompts.add_args(ap)
    ap.add_argument("--modes", default="0,0,auto", help="comma-separated: 0, auto or a built k, each optionally "
                                                         ":DRAFTER; the first is the baseline")
    ap.add_argument("--clients", type=int, default=0, help="a closed loop of this many clients (0: one stream)")
    ap.add_argument("--requests", type=int, default=0, help="requests per mode and repetition under load "
                                                            "(default: 6 per client, at least 32)")
    ap.add_argument("--set", action="append", default=[], metavar="LABEL=FIELD=VALUE",
                    help="an AutoK field of one mode (its label, e.g. auto#2 for a repeated spec; a path such as "
                         "costs.keep; repeatable)")
    ap.add_argument("--quantum", type=float, default=0.0,
                    help="a mode's turn lasts at least this many seconds of its steps (0: one step)")
    a = ap.parse_args()
    specs = a.modes.split(",")
    if len(specs) < 2:
        sys.exit("error: --modes needs a baseline and at least one mode, e.g. --modes 0,0,auto")
    opts = ab_prompts.load_opts(a) | {"max_batch": max(1, a.clients)}
    labels = [s if specs[:i].count(s) == 0 else f"{s}#{specs[:i].count(s) + 1}"  # a repeat: its own column
              for i, s in enumerate(specs)]
    modes = []
    for spec, lab in zip(specs, labels):
        m = Mode(spec, a.engine, opts)
        m.label = lab
        modes.append(m)
    autos = {m.label: m for m in modes if m.k == "auto"}
    fields = {f.name for f in dataclasses.fields(AutoK)}
    for item in a.set:
        label, _, rest = item.partition("=")
        key, _, val = rest.partition("=")
        if label not in autos or key.split(".")[0] not in fields:
            sys.exit(f"error: --set {item!r}: give LABEL=FIELD=VALUE with the label of an auto mode "
                     f"({', '.join(autos) or 'none'}) and a field of AutoK (specexport/autok/controller.py)")
        ab_prompts.set_field(autos[label].dec.autok(), key, val, f"--set {item}")
    prompts = ab_prompts.read(a)
    ab_prompts.warm_up([m.dec for m in modes], prompts)
    for m in autos.values():  # (after the warm-up)
        m.track()
    (under_load if a.clients else single_stream)(a, modes, prompts)


if __name__ == "__main__":
    main()
