"""One verify call of a fused engine at batch B, with its per-row-attention variants against without them.

    .venv/bin/python tools/verify_batch_bench.py engines/load16 [--batches 1,2,4,8,16] [--ks 0,2,4,8] [--reps 30]

Builds with `--max-batch` >= the largest batch (the variants exist for B = 2..16). Without the variants a
multi-token verify at batch B runs the graph once per row; with them, once. k = 0 is the target-only step: the
batched one-token graph without them, the exact step per row with them (what `batch_invariant=True` runs).
Prints the median over --reps calls, in ms, at position 300 of every row (after 3 warm-up calls). An engine
without the variants (max batch 1) takes `--batches 1`: each width's time and its cost over k = 0's, c(k).
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specexport.runtime import SpeculativeDecoder  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine")
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--ks", default="0,2,4,8")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    batches, ks = [int(b) for b in a.batches.split(",")], [int(k) for k in a.ks.split(",")]
    dec = SpeculativeDecoder.load(a.engine, max_batch=max(batches), threads=a.threads, preload=True)
    t = dec.target
    single = not getattr(t, "per_row", False)  # batch 1 only: the variants are for B >= 2
    if single and max(batches) > 1:
        sys.exit(f"{a.engine} has no per-row-attention variants: rebuild it (fused ops, --max-batch > 1), "
                 "or pass --batches 1")
    every = dict(t.graphs)
    without = {n: g for n, g in every.items() if not g.get("rows")}

    def median_ms(variants: bool, B: int, k: int) -> float:
        t.graphs, t.per_row, t.batch_invariant = (every, True, True) if variants else (without, False, False)
        tokens = np.random.default_rng(0).integers(100, 1000, size=(B, k + 1))
        past, draft_len = np.full(B, 300), np.full(B, k)
        u = np.zeros((B, k + 1), np.float32)
        times = []
        for i in range(3 + a.reps):
            t0 = time.perf_counter()
            t.verify(tokens, draft_len, past, 300 + k + 2, k, None, u, None)
            if i >= 3:
                times.append(time.perf_counter() - t0)
        return float(np.median(times)) * 1e3

    if single:  # one row: each width's time, and over k = 0's (the verify cost c(k) in target-only steps)
        ms = {k: median_ms(False, 1, k) for k in ks}
        print("| k | ms | c(k) |\n|---|---|---|")
        for k, m in ms.items():
            print(f"| {k} | {m:.2f} | " + (f"{m / ms[0]:.3f}" if 0 in ms else "-") + " |")
        return
    print("| B | " + " | ".join(f"k={k} (variants / without)" for k in ks) + " |")
    print("|---|" + "---|" * len(ks))
    for B in batches:
        print(f"| {B} | " + " | ".join(f"{median_ms(True, B, k):.1f} / {median_ms(False, B, k):.1f}" for k in ks)
              + " |", flush=True)


if __name__ == "__main__":
    main()
