#!/usr/bin/env python
"""A draft model's pass against a target-only step, in real decoding (issue 11's "a quant:int8 draft pass <= 0.30
of an fp32 target step"): per prompt, one target-only decode and one at a fixed k with the model alone and the
margin stop off (one pass per drafted token), alternating, warm-up excluded; the ratio is the draft's seconds per
pass (GenerationStats.draft_s / drafted) over target-only's seconds per step (verify_s / steps).

    python tools/draft_pass.py engines/bench/se-fp32-int8 [--k 8] [--every 3] [--reps 2]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import ab_prompts  # noqa: E402
from specexport.runtime import SpeculativeDecoder  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--every", type=int, default=3, help="every Nth bench prompt")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    a = ap.parse_args()
    dec = SpeculativeDecoder.load(a.engine, max_batch=1, drafter="model", min_margin=0)
    prompts = [json.loads(line) for line in open(ab_prompts.PROMPTS)][::a.every]
    ab_prompts.warm_up((dec,), prompts[:2])
    ratios = []
    for _ in range(a.reps):
        for p in prompts:
            t = dec.generate(p["prompt"], max_new_tokens=a.max_new_tokens, chat=True, speculative=False)[0].stats
            s = dec.generate(p["prompt"], max_new_tokens=a.max_new_tokens, chat=True, k=a.k)[0].stats
            ratios.append((s.draft_s / s.drafted) / (t.verify_s / t.steps))  # one pass per drafted token
            print(f"{p['id']:14s} {ratios[-1]:.3f}", flush=True)
    print(f"draft pass / target-only step: median {np.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f}, "
          f"{len(ratios)} runs)")


if __name__ == "__main__":
    main()
