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
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import ab_prompts  # noqa: E402
from specexport.bench.report import geomean  # noqa: E402
from specexport.runtime import SpeculativeDecoder  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ab_prompts.add_args(ap)
    a = ap.parse_args()
    opts = ab_prompts.load_opts(a)
    on, off = SpeculativeDecoder.load(a.engine, **opts), SpeculativeDecoder.load(a.engine, **opts)
    off.built_ks = lambda: tuple(sorted(off.target.ks))
    off.autok().free_ks = ()
    print("ks with the free width:", on.built_ks(), "free:", on.target.free_ks, "without:", off.built_ks(),
          "exact_rows:", on.target.exact_rows)
    prompts = ab_prompts.read(a)
    ab_prompts.warm_up((on, off), prompts)
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

    g = geomean
    on_t, off_t, on_off = ([ratio(r, a_, b) for r in res.values()] for a_, b in
                           (("on", "t"), ("off", "t"), ("on", "off")))
    for pid, r, x, y, z in zip(res, res.values(), on_t, off_t, on_off):
        print(f"{pid:14s} auto/t {x:.3f}  no-free/t {y:.3f}  auto/no-free {z:.3f}  free-width steps {r['k1']}  "
              f"same {r['same']}")
    print(f"geomean auto/t {g(on_t):.3f} (min {min(on_t):.3f})  no-free/t {g(off_t):.3f} (min {min(off_t):.3f})  "
          f"auto/no-free {g(on_off):.3f}; identical {sum(r['same'] for r in res.values())}/{len(res)}")


if __name__ == "__main__":
    main()
