"""Replay `k="auto"` offline: batch 1, greedy, over recorded target outputs and draft proposals and measured step
costs, so that rules for specexport/autok are compared without the machine's noise (a 2-core VM's per-prompt A/A ratios
spread by +-10%; a replay is exact, and noise can be added back with a known size).

Why it is exact at greedy: the committed tokens do not depend on the drafter or on k (that is the lossless
contract), so one target-only decode per prompt fixes every step's outcome. Prompt lookup's proposal at a position
is a function of the tokens before it; a draft model's proposal is a function of the committed tokens (its cache
holds only committed positions, or is the target's), recorded at every position by a target-only decode that
asks the drafter before each step (`record`). A replayed step then accepts the matching prefix of its proposal and
costs its measured time, in units of a target-only step c0 (times 1 + noise x N(0, 1) when asked), and the AutoK
controller sees what batch.Batch.step shows it at batch 1: the same plan / width / free_width /
lookup_row_beats_model calls and observe_row / observe_costs observations, in the same order.

Trace (json): {"costs": {"verify": {"j": c(j) / c0}, "draft": d / c0}, "ks": [...], "drafter": {"ngram_min",
"ngram_max", "min_match", "shares_kv", "min_margin"}, "prompts": [{"id", "category", "prompt": [ids], "out": [ids],
"model": {"i": [K draft tokens]}, "margin": {"i": [K - 1 margins]}}]}, where i counts the new tokens committed
before the step (the first comes from prefill); margins (top logit - runner-up of each draft but the last, from
an engine that reports them) let the replay end a chain at a near-tie as ModelDrafter does.
Not modelled: batches > 1, sampling, a draft model's catch-up (costed as none: exact for a draft over the target's
cache, `shares_kv`), the slower target-only step right after a verify (`switch` adds one, in c0), and what the
target would have said past a request's last token (a proposal that matches to the end counts as not rejected).
Cost noise is drawn per prompt and position (seeded by both), so rules compared at one seed meet the same costs
at the same positions. `drift` adds the machine's slow swings on top: one multiplier for every kind of step at a
position, exp(x) with x an AR(1) walk of stationary standard deviation `drift` and correlation length
`drift_steps` positions (on the 2-core VMs the target-only step wandered by 15% within one 128-token request).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from ..autok import AutoK, RowState, matched
from ..drafters import PromptLookupDrafter, hand_over, near_tie
from ..errors import SpecExportError

KINDS = ("lookup", "model", "hybrid")


@dataclass
class Step:
    kd: int  # verify width run (0: target-only)
    passes: int  # draft-model passes (0: none ran)
    proposed: int  # draft tokens verified
    accepted: int
    source: int  # lookup's n-gram length, 0 for the model


@dataclass
class Replay:
    """One trace's prompts replayed with one drafter kind; policy = a fixed k or "auto" (one AutoK over all the
    prompts, in order, as one decoder serves them)."""

    trace: dict
    kind: str = "lookup"
    noise: float = 0.0
    drift: float = 0.0
    drift_steps: float = 32.0
    switch: float = 0.0
    seed: int = 0
    handover: bool = True
    min_margin: float | None = None  # the margin stop (drafters.ModelDrafter); None: the recording's setting
    ks: tuple[int, ...] = field(init=False)

    def __post_init__(self):
        assert self.kind in KINDS, self.kind
        self.ks = tuple(sorted(self.trace["ks"]))
        d = self.trace.get("drafter") or {}
        if not isinstance(d, dict):
            d = {}
        self.min_match = d.get("min_match", 2)  # the hybrid takes lookup's proposal from this n-gram length
        self.handover = bool(d.get("shares_kv")) and self.handover  # the hybrid's model hands over (drafters.py)
        if self.min_margin is None:
            self.min_margin = d.get("min_margin", 0.0)
        self.lookup = PromptLookupDrafter(d.get("ngram_min", 1), d.get("ngram_max", 3))
        self.cost = {int(j): c for j, c in self.trace["costs"]["verify"].items()}
        self.cost[0] = 1.0
        self.d = self.trace["costs"].get("draft")
        if self.kind != "lookup":
            assert self.d is not None and all("model" in p for p in self.trace["prompts"]), \
                "a model or hybrid replay needs a trace recorded from an engine with a draft model"

    def controller(self, **overrides) -> AutoK:
        overrides.setdefault("handover", self.kind == "hybrid" and self.handover)
        return AutoK(self.ks, free_drafts=self.kind == "lookup", **overrides)

    def run(self, prompt: dict, policy, auto: AutoK | None = None, noise=None) -> tuple[float, list[Step]]:
        """-> (decode rate / target-only's, the steps). noise: ([len(out)], [len(out)]) multipliers of the verify
        and the draft cost at each position, or None."""
        ids, out, model = prompt["prompt"], prompt["out"], prompt.get("model", {})
        margins = prompt.get("margin", {})
        K, i, t, steps, row = max(self.ks), 1, 0.0, [], RowState()
        last = 0
        while i < len(out):
            ld, src = [], 0
            if self.kind != "model":  # at auto lookup proposes K, at a fixed k k (its match can differ: drafters.py)
                width = K if auto is not None else policy
                found, src = self.lookup.lookup(np.array(ids + out[:i], dtype=np.int64), width)
                ld = found.tolist()  # [<= K]
            md = model.get(str(i)) if self.kind != "lookup" else []
            assert md is not None, f"the trace has no draft proposal at position {i} of {prompt['id']}"
            use = self.kind == "lookup" or (self.kind == "hybrid" and src >= self.min_match)
            shadow = unused = None
            whole = -1
            if auto is not None:
                if self.kind == "hybrid" and use:
                    whole = auto.free_width(1, [row], [len(ld)], [src], 0)
                    if whole is None:
                        use, whole = False, -1
                free = use if self.kind == "hybrid" else None
                k = auto.plan(1, [row], 0, free)
                if self.kind == "hybrid" and not k and ld and not auto.refreshing \
                        and auto.verify_cost(0, 1) is not None:
                    free, k = True, K  # the model does not pay: lookup alone (batch.py)
                free = auto.free_drafts if free is None else free
            else:
                k, free = policy, use
            ran, prop, source, passes, ho, ties, cut = False, [], 0, k, None, (0, 0), None
            pays = None if auto is None else (lambda j, s, n, k=k: auto.handover_pays(row, s, j, n, k))
            if k:
                if free:
                    prop, source = ld[:k], src
                else:
                    if self.kind == "hybrid" and auto is not None:
                        use = use and auto.lookup_row_beats_model(row, src, len(ld), k)
                    if self.kind == "hybrid" and use:
                        prop, source = ld[:k], src
                    else:
                        prop, passes, ho, ties = self.chain(ids + out[:i], md[:k], margins.get(str(i)), k, pays)
                        unused = ld if self.kind == "hybrid" and auto is not None and ld else None
                    ran = True
                L = len(prop)
                if auto is not None and ho is not None and auto.trim_handover:  # a handover: how far to verify
                    L = auto.handover_width(1, [row], [ho[0]], [L], [ho[1]], passes)
                    cut, prop = ((prop[L], ho[1]) if L < len(prop) else None), prop[:L]
                    ho = ho if L > ho[0] else None  # (batch.py: cut back to the model's tokens)
                if auto is not None and not ran and L and whole < 0:  # free proposals: choose what to verify
                    capped = min(L, auto.cap(row, source))
                    j = auto.width(1, [row], [capped], [source])
                    shadow, L = (prop[0], 0) if j == 0 else (None, min(capped, j))
            else:
                L = 0
                if ld and auto is not None and self.kind == "hybrid":
                    shadow, source = ld[0], src
            kd = min(kk for kk in self.ks if kk >= L) if L else 0
            full = matched(prop[:L], out[i:]) if L else 0
            n = min(full, len(out) - i - 1)  # (the request ends at len(out))
            nv, nd = (noise[0][i], noise[1][i]) if noise is not None else (1.0, 1.0)
            vt = self.cost[kd] * nv + (self.switch if kd == 0 and last else 0.0)
            dt = passes * self.d * nd if ran else 0.0
            if auto is not None:
                known = full < len(out) - i  # a match to the end of the recorded tokens: not known to be rejected
                auto.observe_verify(row, out[i:i + n + 1], n, L, source, full=full if known else math.inf,
                                    handover=ho, tied=ties[0] > 0 if ran else None, shadow=shadow, unused=unused,
                                    unused_source=src, cut=cut)
                auto.observe_costs(1, kd, vt, passes if ran else 0, dt)
                if ties[1]:
                    auto.observe_ties(*ties)
                auto.end_step(k if ran or self.kind != "hybrid" else 0, [row])
            steps.append(Step(kd, passes if ran else 0, L, n, source))
            t += vt + dt
            i += n + 1
            last = kd
        # target-only: a step of c0 = 1 at every position but the first (the prefill's), under the same noise
        base = float(np.sum(noise[0][1:len(out)])) if noise is not None else len(out) - 1
        return base / t, steps

    def chain(self, seq: list[int], md: list[int], margin: list[float] | None, k: int, pays=None
              ) -> tuple[list[int], int, tuple[int, int] | None, tuple[int, int]]:
        """The model's chain of passes as ModelDrafter runs it: after each pass but the last, a near-tie ends it
        (the margin stop), else the hybrid's handover rule (drafters.hand_over, where pays(j, source, n) allows:
        AutoK.handover_pays) may -> (proposal, passes, (j, n) or None, (near-ties, positions checked))."""
        check = margin is not None and self.min_margin > 0
        for j in range(1, k):
            if check and j <= len(margin) and near_tie(margin[j - 1], self.min_margin):
                return md[:j], j, None, (1, j)
            if self.kind == "hybrid" and self.handover:
                rest = hand_over(self.lookup, self.min_match, np.array(seq + md[:j], dtype=np.int64), k - j)
                if rest is not None and (pays is None or pays(j, rest[1], len(rest[0]))):
                    return md[:j] + rest[0].tolist(), j, (j, rest[1]), (0, j if check else 0)
        return md, k, None, (0, k - 1 if check else 0)

    def swings(self, n: int, rng) -> np.ndarray:
        """[n] log-multipliers: an AR(1) walk from its stationary law (sd `drift`, correlation exp(-1/`drift_steps`)
        per position)."""
        rho = math.exp(-1.0 / self.drift_steps)
        e = rng.normal(size=n) * self.drift
        x = np.empty(n)
        x[0] = e[0]
        for i in range(1, n):
            x[i] = rho * x[i - 1] + math.sqrt(1 - rho * rho) * e[i]
        return x

    def compare(self, **overrides) -> dict:
        """Every prompt at each fixed k and at auto -> per-prompt ratios to target-only and the summary."""
        auto = self.controller(**overrides)
        rows = []
        for idx, p in enumerate(self.trace["prompts"]):
            noise = None
            if self.noise or self.drift:  # per prompt and position: every policy meets the same costs there
                z = np.random.default_rng([self.seed, idx]).normal(size=(2, len(p["out"])))
                noise = np.maximum(1 + self.noise * z, 0.1)
                if self.drift:
                    noise = noise * np.exp(self.swings(len(p["out"]), np.random.default_rng([self.seed, idx, 1])))
            r = {"id": p["id"], "steps": None}
            for pol in (*self.ks, "auto"):
                rate, steps = self.run(p, pol, auto if pol == "auto" else None, noise)
                r[pol] = rate
                if pol == "auto":
                    r["steps"] = steps
            rows.append(r)
        return summarize(rows, self.ks)


def summarize(rows: list[dict], ks: tuple[int, ...]) -> dict:
    def gm(xs):
        return math.exp(sum(math.log(x) for x in xs) / len(xs))
    fixed = {k: gm([r[k] for r in rows]) for k in ks}
    single = max(fixed, key=fixed.get)
    return {"rows": rows, "min_auto": min(r["auto"] for r in rows),
            "worst": min(rows, key=lambda r: r["auto"])["id"],
            "auto": gm([r["auto"] for r in rows]), "fixed": fixed,
            "auto_vs_best": gm([r["auto"] / max(1.0, *(r[k] for k in ks)) for r in rows]),
            "auto_vs_single": gm([r["auto"] / max(1.0, r[single]) for r in rows]), "single_k": single}


def record(engine: str, prompts: list[dict], max_new_tokens: int = 128, prepack: bool | None = None,
           threads: int | None = None, chat: bool = True, log=print) -> dict:
    """A trace from an engine (ONNX Runtime, batch 1): each prompt's target-only greedy tokens and, with a draft
    model, its K-token proposal before every step; c(j) / c0 for every built k, timed inside that decoding
    (`_WidthTimer`), and the draft pass d / c0 (the median K-token proposal / K)."""
    from ..batch import Batch
    from ..drafters import DraftInputs, HybridDrafter, ModelDrafter
    from ..runtime import SpeculativeDecoder
    opts = dict(max_batch=1, preload=True)
    if prepack is not None:
        opts["prepack"] = prepack
    if threads:
        opts["threads"] = threads
    dec = SpeculativeDecoder.load(engine, **opts)
    d = dec.drafter
    model = d.model if isinstance(d, HybridDrafter) else (d if getattr(d, "engine", None) is not None else None)
    if model is not None:  # every proposal K tokens long, with its margins: the replay applies the stop
        model = ModelDrafter(model.engine, model.name, report_margins=True)
    ks = dec.built_ks()
    K = max(ks)
    chat = chat and bool(getattr(dec.tokenizer, "chat_template", None))
    passes: list[float] = []
    timer = _WidthTimer(dec.target, ks, dec.config.cache_len)

    class Recorder(Batch):
        """Target-only steps; before each, the draft model's K-token proposal from the committed tokens (and, at
        every `_WidthTimer.every`-th step, one timed verify of each width)."""
        def _plan_k(self, rows, B, free=False):
            return 0

        def step(self):
            timer.maybe_time(self.current[:1], self.past_len[:1])
            if model is not None:
                if not getattr(model, "shares_kv", False):
                    self._catch_up_draft([0], 1)  # its own cache: every committed position but the current one
                x = DraftInputs(np.stack([self.prev[:1], self.current[:1]], 1), self.past_len[:1],  # [1, 2], [1]
                                int(self.past_len[0]) + K + 1, self.history[:1], self.lengths[:1], None,
                                np.zeros((1, K), np.float32))
                t = time.perf_counter()
                prop = model.propose(x, K)
                passes.append((time.perf_counter() - t) / K)
                at = str(self.lengths[0] - self.prompt_len)
                self.proposals[at] = prop.draft[0, :int(prop.draft_len[0])].tolist()
                if prop.margin is not None:
                    self.margins[at] = [round(float(m), 4) for m in prop.margin[0]]
            return super().step()

    warm = dec.encode("Say hello in one short sentence." if dec.tokenizer is not None else prompts[0]["prompt"], chat)
    out = []
    for p in [{"id": "warm-up", "prompt": None}] + list(prompts):
        ids = warm if p["prompt"] is None else dec.encode(p["prompt"], chat=chat)
        reqs = dec._prepare([ids], max_new_tokens if p["prompt"] is not None else 8, None, False, ())
        batch = Recorder(dec, model is not None, K)
        batch.proposals, batch.margins, batch.prompt_len = {}, {}, len(ids)
        batch.admit([0], reqs)
        while batch.rows():
            batch.step()
        if p["prompt"] is None:
            passes.clear()
            timer.clear()
            continue
        out.append({"id": p["id"], "category": p.get("category", ""), "prompt": list(map(int, ids)),
                    "out": list(map(int, reqs[0].out))} | ({"model": batch.proposals} if model else {})
                   | ({"margin": batch.margins} if batch.margins else {}))
        log(f"[record] {p['id']}: {len(reqs[0].out)} tokens")
    verify, c0 = timer.costs()
    costs = {"verify": verify, "c0_s": c0}
    if model is not None:
        costs["draft"] = round(float(np.median(passes)) / c0, 4)
    log(f"[record] costs (x a target-only step): verify {costs['verify']}" +
        (f", draft pass {costs['draft']:.3f}" if model is not None else ""))
    cfg = dec.config
    drafter = {"name": getattr(d, "name", None), "ngram_min": cfg.ngram_min, "ngram_max": cfg.ngram_max,
               "min_match": cfg.min_match, "shares_kv": bool(getattr(model, "shares_kv", False)),
               "min_margin": cfg.min_margin}
    if model is not None and not drafter["shares_kv"]:
        log("[record] the draft keeps its own cache: a replay costs its catch-up as none")
    return {"engine": engine, "ks": list(ks), "drafter": drafter, "costs": costs, "prompts": out}


class _WidthTimer:
    """c(j) / c0 as real decoding meets it: at every `every`-th step of the recording's decode, one verify call of
    each width (0 and the built ks, in alternating order) at the current position, row 0 the current token and its
    drafts copies of it; each c(j) / c0 is the median over those steps of c(j) over the same step's c(0). Timed
    calls next to each other see the same machine (its drift cancels in the ratio) and the positions, context
    lengths and caches of the decode itself. They change nothing: they write the cache at the current position and
    past it, which the step's own pass and the later steps overwrite before anything reads it (a draft model's
    catch-up copies only positions before the current one).
    On se-int4 (8 bench prompts x 2) this read c(2, 4, 8) 1.42, 1.88, 2.78 against 1.42, 1.89, 2.91 for the verify
    calls of real speculative decoding, where the former 15-call blocks at one context length read 1.31, 1.83,
    2.87 (and 1.51, 1.63, 2.43 in another recording)."""

    every = 4

    def __init__(self, target, ks: tuple[int, ...], cache_len: int):
        self.target, self.ks, self.cache_len, self.steps = target, ks, cache_len, 0
        self.ratios: dict[int, list[float]] = {kd: [] for kd in ks}
        self.c0: list[float] = []

    def maybe_time(self, current: np.ndarray, past_len: np.ndarray) -> None:
        """current, past_len [1]: the step about to run."""
        self.steps += 1
        room = self.cache_len - int(past_len[0]) - 1
        if self.steps % self.every or room < max(self.ks):
            return
        order = (0, *self.ks) if (self.steps // self.every) % 2 else (*self.ks[::-1], 0)
        took = {}
        for kd in order:
            toks = np.repeat(current[:, None], kd + 1, 1)  # [1, kd+1]
            t = time.perf_counter()
            self.target.verify(toks, np.array([kd]), past_len.copy(), int(past_len[0]) + kd + 1, kd, None,
                               np.zeros((1, kd + 1), np.float32), None)
            took[kd] = time.perf_counter() - t
        self.c0.append(took[0])
        for kd in self.ks:
            self.ratios[kd].append(took[kd] / took[0])

    def clear(self) -> None:
        self.ratios, self.c0 = {kd: [] for kd in self.ks}, []

    def costs(self) -> tuple[dict[str, float], float]:
        """-> ({"j": c(j) / c0}, c0 in seconds)."""
        if not self.c0:
            raise SpecExportError(f"the recording timed no verify: its prompts decoded fewer than {self.every} steps "
                                  "in all; record longer outputs (--max-new-tokens)")
        return ({str(kd): round(float(np.median(v)), 4) for kd, v in self.ratios.items()},
                float(np.median(self.c0)))
