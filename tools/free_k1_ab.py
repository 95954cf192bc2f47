#!/usr/bin/env python
"""k="auto" with the free width (OrtEngine.free_ks: CPUs where the exact target-only step is a verify, the 2-row
verify_k1 or the narrowest built k's) against auto without it (over the built ks only, none of them costed as
free), side by side: two decoders over one engine in one process, target-only, auto and auto without the free
width on every prompt before the next, warm-up excluded. Greedy, batch 1, chat template, 128 new tokens, the
prompts of ../shared/bench/prompts.jsonl (every n-th, to --prompts-n). Prints each prompt's median ratios over
the repetitions (decode rates, prefill excluded), their geometric means and minima, and whether all three gave
the same tokens.

    python tools/free_k1_ab.py engines/smollm2 --reps 2
    python tools/free_k1_ab.py engines/bench/se-fp32 --no-prepack --prompts-n 8 --reps 1   # free k = 2 there
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specexport.runtime import SpeculativeDecoder  # noqa: E402

PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "bench" / "prompts.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts", default=str(PROMPTS))
    ap.add_argument("--prompts-n", type=int, default=0, help="this many of the prompts, evenly spaced (0: all)")
    ap.add_argument("--no-prepack", action="store_true")
    a = ap.parse_args()
    opts = dict(threads=2, max_batch=1, prepack=not a.no_prepack)
    on, off = SpeculativeDecoder.load(a.engine, **opts), SpeculativeDecoder.load(a.engine, **opts)
    off.built_ks = lambda: tuple(sorted(off.target.ks))
    off.autok().free_ks = ()
    print("ks with the free width:", on.built_ks(), "free:", on.target.free_ks, "without:", off.built_ks(),
          "exact_rows:", on.target.exact_rows)
    prompts = [json.loads(line) for line in open(a.prompts)]
    if a.prompts_n:
        prompts = prompts[::max(1, len(prompts) // a.prompts_n)][:a.prompts_n]
    for p in prompts[:2]:  # warm-up
        for d in (on, off):
            d.generate(p["prompt"], max_new_tokens=16, chat=True, k="auto")
    res, n = {}, a.max_new_tokens
    for _ in range(a.reps):
        for p in prompts:
            row = res.setdefault(p["id"], {"t": [], "on": [], "off": [], "k1": [], "same": True})
            base = on.generate(p["prompt"], max_new_tokens=n, chat=True, speculative=False)[0]
            x = on.generate(p["prompt"], max_new_tokens=n, chat=True, k="auto")[0]
            y = off.generate(p["prompt"], max_new_tokens=n, chat=True, k="auto")[0]
            for key, o in (("t", base), ("on", x), ("off", y)):
                row[key].append(o.stats.decode_rate)
            row["k1"].append(sum(x.stats.k_steps.get(j, 0) for j in on.target.free_ks))
            row["same"] &= x.token_ids == base.token_ids == y.token_ids

    def ratio(r, a_, b):
        return float(np.median(np.array(r[a_]) / np.array(r[b])))

    def g(xs):
        return float(np.exp(np.mean(np.log(xs))))
    on_t, off_t, on_off = ([ratio(r, a_, b) for r in res.values()] for a_, b in
                           (("on", "t"), ("off", "t"), ("on", "off")))
    for pid, r, x, y, z in zip(res, res.values(), on_t, off_t, on_off):
        print(f"{pid:14s} auto/t {x:.3f}  no-free/t {y:.3f}  auto/no-free {z:.3f}  free-width steps {r['k1']}  "
              f"same {r['same']}")
    print(f"geomean auto/t {g(on_t):.3f} (min {min(on_t):.3f})  no-free/t {g(off_t):.3f} (min {min(off_t):.3f})  "
          f"auto/no-free {g(on_off):.3f}; identical {sum(r['same'] for r in res.values())}/{len(res)}")


if __name__ == "__main__":
    main()
