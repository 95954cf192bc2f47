#!/usr/bin/env python
"""One engine against ONNX Runtime GenAI at one precision, side by side in one process: target-only (and, with
--auto, k="auto") on each prompt, the two systems in alternating order per prompt and repetition, warm-up
excluded. Greedy, chat template, the bench prompts (every n-th, to --prompts-n). Prints decode tok/s (prefill
excluded, tokens 2..n as `specexport bench --peers` counts them) as geometric means and ours / theirs.

A two-system run is quieter than the 15-system `specexport bench --peers` and takes minutes, not an hour:

    python tools/peer_ab.py engines/bench/se-int4 --precision int4 --prompts-n 6 --reps 2
    python tools/peer_ab.py engines/bench/se-fp32 --precision fp32 --profile /tmp/prof
    python tools/peer_ab.py engines/bench/se-int4 --precision int4 --prompts-n 24 --auto --ngram 4 --plain

--ngram N also runs ORT GenAI with its n-gram speculation (N draft tokens, 2-grams); ours / theirs is then against
its better mode over all the prompts, as `specexport bench --peers` scores "the best mode of each peer".

--plain adds our target-only decode through the plain one-token graph (`verify_k0`, whose attention's one-row
kernel rounds differently from every verify's) in place of the exact step (`verify_k0_exact`, the current token's
attention on two rows): the exact step's price, with how often its tokens stay ours.

--temperature T [--top-p P] samples instead of greedy: ours with a seed per run (every sampling graph opened at
load), theirs with its own sampler (top_k at the vocabulary size, as our top_k 0); token agreement is then chance.

    python tools/peer_ab.py ENGINE --precision fp32 --prompts-n 8 --auto --temperature 0.7 --top-p 0.9

--profile DIR writes ONNX Runtime's per-node profiles of both (ours: one file per session; theirs: og_*.json)
and prints the decode steps' kernel time per op type (the profiler's own overhead is in both).
Needs the [peers] extra (`bash tools/install_peers.sh`, or `pip install -e .[peers]` for ORT GenAI alone).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gc
import glob
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specexport.bench.peers import OrtGenAIPeer, chat_ids, hf_tokenizer, prepare_ortgenai_models  # noqa: E402
from specexport.models.loading import default_model_path  # noqa: E402
from specexport.config import SamplingParams  # noqa: E402
from specexport.runtime import SpeculativeDecoder  # noqa: E402

PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "bench" / "prompts.jsonl"


def op_times(path: str, one_token: bool) -> tuple[int, float, float, dict[str, float]]:
    """A profile's decode runs: (runs, mean run us, mean kernel us, op type -> mean us per run). one_token: keep
    only runs whose embedding lookup reads one token per row (ORT GenAI's one session serves prefill too)."""
    ev = json.load(open(path))
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("cat") == "Session" and e["name"] == "model_run")
    starts = [r[0] for r in runs]
    per = [collections.Counter() for _ in runs]
    single = [not one_token] * len(runs)
    for e in ev:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
            continue
        i = bisect.bisect_right(starts, e["ts"]) - 1
        if i < 0 or e["ts"] > runs[i][1]:
            continue
        op = e["args"]["op_name"]
        per[i][op] += e["dur"]
        if one_token and op in ("Gather", "GatherBlockQuantized"):
            single[i] = single[i] or any(list(d.values())[0] == [1, 1] for d in e["args"]["input_type_shape"])
    keep = [i for i in range(len(runs)) if single[i]][3:]  # the first runs warm up
    if not keep:
        return 0, 0.0, 0.0, {}
    ops = collections.Counter()
    for i in keep:
        ops.update(per[i])
    n = len(keep)
    return (n, sum(runs[i][1] - runs[i][0] for i in keep) / n, sum(ops.values()) / n,
            {k: v / n for k, v in ops.most_common()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine")
    ap.add_argument("--precision", choices=("fp32", "int4"), required=True, help="ORT GenAI's model to run")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--prompts-n", type=int, default=6, help="how many of the bench prompts (evenly spaced)")
    ap.add_argument("--auto", action="store_true", help="our k=auto too")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts", default=str(PROMPTS))
    ap.add_argument("--profile", metavar="DIR", help="write and summarize ONNX Runtime profiles")
    ap.add_argument("--rows", type=int, choices=(1, 2), help="force our batch-1 target-only step to this many rows "
                    "(`exact_rows`; 1 on a CPU that needs 2 is the inexact step: the exact step's price)")
    ap.add_argument("--ngram", type=int, default=0, metavar="N",
                    help="also ORT GenAI with its n-gram speculation (N draft tokens): ours against its best mode")
    ap.add_argument("--plain", action="store_true", help="also our target-only through the plain one-token graph")
    ap.add_argument("--each", action="store_true", help="print every run: prompt, its tokens, each mode's tok/s")
    ap.add_argument("--between", metavar="ENGINE", nargs="+", default=[],
                    help="engines loaded beside both and run (target-only, 32 tokens) before every measured run, as "
                         "the whole bench's other systems run between each system's prompts")
    ap.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0)
    a = ap.parse_args()
    sample = (a.temperature, a.top_p) if a.temperature > 0 else None
    gguf = default_model_path()
    prof = os.path.abspath(a.profile) if a.profile else None
    if prof:
        os.makedirs(prof, exist_ok=True)
        os.environ["SPECEXPORT_ORT_CAPI"] = "0"  # Python sessions (the C API's have no profiler switch here)
        from specexport.backends import ort_engine
        plain = ort_engine.OrtEngine._session_options

        def profiled(self, prepack):
            so = plain(self, prepack)
            so.enable_profiling, so.profile_file_prefix = True, f"{prof}/se"
            return so
        ort_engine.OrtEngine._session_options = profiled
    ours = SpeculativeDecoder.load(a.engine, threads=2, max_batch=1, prepack=True, preload=True if sample else None)
    if a.rows:
        ours.target._exact_rows = a.rows
    model_dir = prepare_ortgenai_models(gguf, precisions=(a.precision,))[a.precision]
    theirs = OrtGenAIPeer(model_dir, threads=2, session_options={"enable_profiling": f"{prof}/og"} if prof else None,
                          sample=sample)
    peer_modes = {"theirs": theirs} | ({f"theirs, n-gram {a.ngram}": OrtGenAIPeer(model_dir, ngram=a.ngram, threads=2,
                                                                                   sample=sample)}
                                       if a.ngram else {})
    tok = hf_tokenizer(gguf)
    prompts = [json.loads(line) for line in open(a.prompts)]
    prompts = prompts[::max(1, len(prompts) // a.prompts_n)][:a.prompts_n]
    modes = {"target-only": dict(speculative=False)} | ({"auto": dict(k="auto")} if a.auto else {}) | \
        ({"target-only, plain": dict(speculative=False)} if a.plain else {})
    exact_verify = ours.target.verify

    def plain_verify(tokens, draft_len, past_len, kv_len, k, *rest):  # the one-token graph, not verify_k0_exact
        ours.target.fused = k != 0
        try:
            return exact_verify(tokens, draft_len, past_len, kv_len, k, *rest)
        finally:
            ours.target.fused = True
    def sampling(seed: int) -> SamplingParams | None:
        return SamplingParams(a.temperature, 0, a.top_p, seed=seed) if sample else None
    ids0 = chat_ids(tok, prompts[0]["prompt"])
    others = [SpeculativeDecoder.load(e, threads=2, max_batch=1, prepack=True) for e in a.between]

    def between():
        for o in others:
            o.generate(ids0, max_new_tokens=32, speculative=False)
    for kw in modes.values():
        ours.generate(ids0, max_new_tokens=16, sampling=sampling(0), **kw)
    for peer in peer_modes.values():
        peer.generate(ids0, 16)
    rates: dict[str, list[float]] = {m: [] for m in modes} | {m: [] for m in peer_modes}
    same = plain_same = 0
    for rep in range(a.reps):
        for i, p in enumerate(prompts):
            ids = chat_ids(tok, p["prompt"])
            each = {}
            for who in (("ours", "theirs") if (rep + i) % 2 == 0 else ("theirs", "ours")):
                if who == "theirs":
                    for m, peer in peer_modes.items():
                        between()
                        out, dec_s, _ = peer.generate(ids, a.max_new_tokens)
                        rates[m].append((len(out) - 1) / dec_s if len(out) > 1 else 0.0)
                        each[m] = f"{rates[m][-1]:.1f} ({len(out)})"
                        if m == "theirs":
                            toks = out
                    continue
                for m, kw in modes.items():
                    between()
                    ours.target.verify = plain_verify if m.endswith("plain") else exact_verify
                    seed = 1 + rep * len(prompts) + i
                    o = ours.generate(ids, max_new_tokens=a.max_new_tokens, sampling=sampling(seed), **kw)[0]
                    rates[m].append(o.stats.decode_rate)
                    each[m] = f"{rates[m][-1]:.1f} ({len(o.token_ids)})"
                    if m == "target-only":
                        mine = list(o.token_ids)
                    elif m.endswith("plain"):
                        plain_same += list(o.token_ids) == mine
            same += mine == toks[:len(mine)]
            if a.each:
                print(f"{p['id']:14s} prompt {len(ids):4d}: " + ", ".join(f"{m} {v}" for m, v in each.items()),
                      flush=True)

    def g(xs):
        return float(np.exp(np.mean(np.log(xs))))
    for m in peer_modes:
        print(f"ORT GenAI {a.precision}{m[6:]}: {g(rates[m]):.1f} tok/s")
    best = max(peer_modes, key=lambda m: g(rates[m]))  # their best mode over all the prompts
    t = np.array(rates[best])
    if len(peer_modes) > 1:
        print(f"ours / theirs below: against ORT GenAI {a.precision}{best[6:]}, its best mode here "
              f"(target-only also against its plain mode)")
    for m in modes:
        r = np.array(rates[m])
        plain = f", / its plain mode {g(r / np.array(rates['theirs'])):.3f}" \
            if best != "theirs" and m.startswith("target-only") else ""
        print(f"ours {m}: {g(r):.1f} tok/s, ours / theirs {g(r / t):.3f} (per run: min {np.min(r / t):.3f}, "
              f"max {np.max(r / t):.3f}){plain}")
    if a.auto:  # our auto over our target-only, per category (issue 12's measure), runs in the loop's order
        cats = [p["category"] for _ in range(a.reps) for p in prompts]
        ratio = np.array(rates["auto"]) / np.array(rates["target-only"])
        per = {c: g(ratio[[i for i, x in enumerate(cats) if x == c]]) for c in sorted(set(cats))}
        print("ours auto / ours target-only: " + ", ".join(f"{c} {v:.2f}" for c, v in per.items()) +
              f"; all {g(ratio):.2f}")
    print(f"same tokens as ORT GenAI {same}/{len(t)}" + (f"; the plain step's tokens equal our exact step's "
                                                          f"{plain_same}/{len(t)}" if a.plain else ""))
    if prof:
        for s in ours.target._sessions.values():
            s.end_profiling()
        del theirs, peer_modes  # (ORT GenAI writes its profile when its model goes)
        gc.collect()
        for path in sorted(glob.glob(f"{prof}/*.json")):
            try:
                n, run_us, kern_us, ops = op_times(path, one_token=os.path.basename(path).startswith("og"))
            except json.JSONDecodeError:  # not written out
                print(f"{os.path.basename(path)}: unreadable")
                continue
            if n < 10:
                continue
            print(f"{os.path.basename(path)}: {n} decode runs, {run_us:.0f} us per run, kernels {kern_us:.0f} us")
            print("  " + ", ".join(f"{k} {v:.0f}" for k, v in ops.items()))


if __name__ == "__main__":
    main()
