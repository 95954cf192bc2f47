#!/usr/bin/env python
"""Two engines (or one engine two ways) side by side at batch 1: target-only, and optionally k="auto", on each
prompt for A then B (the order alternating per prompt and repetition), warm-up excluded. Greedy, chat template,
the bench prompts (every n-th, to --prompts-n). Prints decode tok/s (prefill excluded) as geometric means, B / A
per mode, and how often A and B gave the same tokens. --temperature (with --top-k, --top-p) samples instead, with
the same seed for A and B on each run (one per prompt and repetition), every sampling graph opened at load.

    python tools/engine_ab.py engines/bench/q41-b1 engines/bench/other --reps 2 --prompts-n 6
    python tools/engine_ab.py engines/smollm2 engines/smollm2 --b-rows 1    # the exact 2-row step vs 1 row
    python tools/engine_ab.py engines/smollm2 /tmp/q41-nomins --ignore-eos  # what a term costs (strip_terms.py)
    python tools/engine_ab.py OLD NEW --auto --temperature 0.7 --top-p 0.9      # sampling

--b-rows N forces B's batch-1 target-only step to N rows (`exact_rows`): 1 on a CPU whose one-row quantized
linears round differently (backends/row_probe.py) is the inexact step, so its tokens may differ, and the ratio is
the price of the exact step; 2 runs the step as the 2-row `verify_k1` graph (an engine built with k = 1).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specexport.bench.report import geomean  # noqa: E402
from specexport.config import SamplingParams  # noqa: E402
from specexport.runtime import SpeculativeDecoder  # noqa: E402

PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "bench" / "prompts.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--prompts-n", type=int, default=8, help="how many of the bench prompts (evenly spaced)")
    ap.add_argument("--auto", action="store_true", help="k=auto too")
    ap.add_argument("--b-rows", type=int, choices=(1, 2), help="B's batch-1 target-only step on this many rows")
    ap.add_argument("--no-prepack", action="store_true")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts", default=str(PROMPTS))
    ap.add_argument("--ignore-eos", action="store_true", help="every run decodes --max-new-tokens (timing an engine "
                    "whose values are wrong: tools/strip_terms.py)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (0: greedy)")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    a = ap.parse_args()
    opts = dict(threads=2, max_batch=1, prepack=not a.no_prepack, preload=True if a.temperature > 0 else None)
    dec = {"A": SpeculativeDecoder.load(a.a, **opts), "B": SpeculativeDecoder.load(a.b, **opts)}
    if a.ignore_eos:
        for d in dec.values():
            d.eos_token_ids = frozenset()
    if a.b_rows:
        dec["B"].target._exact_rows = a.b_rows
    prompts = [json.loads(line) for line in open(a.prompts)]
    prompts = prompts[::max(1, len(prompts) // a.prompts_n)][:a.prompts_n]
    modes = {"target-only": dict(speculative=False)} | ({"auto": dict(k="auto")} if a.auto else {})
    def sampling(seed: int) -> SamplingParams | None:
        return SamplingParams(a.temperature, a.top_k, a.top_p, seed=seed) if a.temperature > 0 else None
    for d in dec.values():
        for kw in modes.values():
            d.generate(prompts[0]["prompt"], max_new_tokens=16, chat=True, sampling=sampling(0), **kw)
    rates = {m: {"A": [], "B": []} for m in modes}
    same = {m: 0 for m in modes}
    for rep in range(a.reps):
        for i, p in enumerate(prompts):
            for m, kw in modes.items():
                toks = {}
                for name in ("AB" if (rep + i) % 2 == 0 else "BA"):
                    o = dec[name].generate(p["prompt"], max_new_tokens=a.max_new_tokens, chat=True,
                                           sampling=sampling(1 + rep * len(prompts) + i), **kw)[0]
                    rates[m][name].append(o.stats.decode_rate)
                    toks[name] = o.token_ids
                same[m] += toks["A"] == toks["B"]

    g = geomean
    for m, r in rates.items():
        ra, rb = np.array(r["A"]), np.array(r["B"])
        x = rb / ra
        print(f"{m}: A {g(ra):.1f} tok/s, B {g(rb):.1f} tok/s, B / A {g(x):.3f} (per run: min {np.min(x):.3f}, "
              f"max {np.max(x):.3f}); same tokens {same[m]}/{len(ra)}")


if __name__ == "__main__":
    main()
