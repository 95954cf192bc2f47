#!/usr/bin/env python
"""2 MB pages for the pre-packed weights (backends/hugepages.py) against 4 KB pages, step by step: one process
loads the engine twice, each with its own pre-packed copy (the second with SPECEXPORT_HUGEPAGES=0), and times
the same step on each in alternating blocks of 10 calls, warm-up excluded; prints the median step time of each
and the ratio. Steps: a target-only step (`0`, the engine's exact step), a verify at k (`4`), a draft pass
(`draft`, an engine with a draft model), at cache position --pos.

    python tools/hugepages_ab.py engines/bench/se-fp32-int8 --steps draft,0,4 [--pos 300] [--blocks 30]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specexport.backends import ort_memory  # noqa: E402
from specexport.runtime import SpeculativeDecoder  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine")
    ap.add_argument("--steps", default="0,4", help="comma-separated: draft, or a verify's k (0: target-only)")
    ap.add_argument("--pos", type=int, default=300, help="the cache position the steps run at")
    ap.add_argument("--blocks", type=int, default=30, help="alternating blocks of 10 calls per engine")
    a = ap.parse_args()
    steps = [s if s == "draft" else int(s) for s in a.steps.split(",")]
    drafter = "model" if "draft" in steps else "prompt-lookup"

    def load(huge: bool) -> SpeculativeDecoder:
        os.environ["SPECEXPORT_HUGEPAGES"] = "1" if huge else "0"
        ort_memory._CONTAINER = None  # its own pre-packed copy
        t = time.perf_counter()
        d = SpeculativeDecoder.load(a.engine, max_batch=1, threads=2, drafter=drafter)
        d.generate("Hello there, how are you?", max_new_tokens=8, chat=True, speculative=False)
        engines = [d.target] + ([d.drafter.engine] if drafter == "model" else [])
        print(f"{'2 MB' if huge else '4 KB'}: loaded in {time.perf_counter() - t:.1f} s, "
              f"{sum(e.huge_bytes for e in engines) >> 20} MB advised to 2 MB pages", flush=True)
        return d
    huge, small = load(True), load(False)

    def step(d: SpeculativeDecoder, s):
        pos = np.array([a.pos])
        if s == "draft":
            return lambda: d.drafter.engine.draft(np.array([[5, 6]]), pos, a.pos + 9, 1, None, None)
        toks = np.full((1, s + 1), 7, np.int64)
        return lambda: d.target.verify(toks, np.array([s]), pos, a.pos + s + 1, s, None, None, None)
    for s in steps:
        fh, fs = step(huge, s), step(small, s)
        for f in (fh, fs, fh, fs):
            f()
        th, ts = [], []
        for i in range(a.blocks):
            for f, t in ((fh, th), (fs, ts)) if i % 2 == 0 else ((fs, ts), (fh, th)):
                for _ in range(10):
                    t0 = time.perf_counter()
                    f()
                    t.append(time.perf_counter() - t0)
        mh, ms = np.median(th) * 1e3, np.median(ts) * 1e3
        name = "draft pass" if s == "draft" else "target-only step" if s == 0 else f"verify k={s}"
        print(f"{name}: 2 MB pages {mh:.2f} ms, 4 KB pages {ms:.2f} ms, 4 KB / 2 MB {ms / mh:.3f}", flush=True)


if __name__ == "__main__":
    main()
