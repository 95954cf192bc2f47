#!/usr/bin/env python
"""k="auto" with the free k = 1 (OrtEngine.free_ks: CPUs where the exact target-only step is the 2-row verify_k1)
against auto over the built ks only, side by side: two decoders over one engine in one process, target-only,
auto and auto without k = 1 on every prompt before the next, warm-up excluded. Greedy, batch 1, chat template,
128 new tokens, the 24 prompts of ../shared/bench/prompts.jsonl. Prints each prompt's median ratios over the
repetitions (decode rates, prefill excluded), their geometric means and minima, and whether all three gave the
same tokens.

    python tools/free_k1_ab.py engines/smollm2 --reps 2
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
    a = ap.parse_args()
    on = SpeculativeDecoder.load(a.engine, threads=2, max_batch=1)
    off = SpeculativeDecoder.load(a.engine, threads=2, max_batch=1)
    off.built_ks = lambda: tuple(sorted(off.target.ks))
    print("ks with free k=1:", on.built_ks(), "without:", off.built_ks(), "exact_rows:", on.target.exact_rows)
    prompts = [json.loads(line) for line in open(a.prompts)]
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
            row["k1"].append(x.stats.k_steps.get(1, 0))
            row["same"] &= x.token_ids == base.token_ids == y.token_ids

    def ratio(r, a_, b):
        return float(np.median(np.array(r[a_]) / np.array(r[b])))

    def g(xs):
        return float(np.exp(np.mean(np.log(xs))))
    on_t, off_t, on_off = ([ratio(r, a_, b) for r in res.values()] for a_, b in
                           (("on", "t"), ("off", "t"), ("on", "off")))
    for pid, r, x, y, z in zip(res, res.values(), on_t, off_t, on_off):
        print(f"{pid:14s} auto/t {x:.3f}  no-k1/t {y:.3f}  auto/no-k1 {z:.3f}  k=1 steps {r['k1']}  same {r['same']}")
    print(f"geomean auto/t {g(on_t):.3f} (min {min(on_t):.3f})  no-k1/t {g(off_t):.3f} (min {min(off_t):.3f})  "
          f"auto/no-k1 {g(on_off):.3f}; identical {sum(r['same'] for r in res.values())}/{len(res)}")


if __name__ == "__main__":
    main()
