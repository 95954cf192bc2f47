#!/usr/bin/env python
"""Decode speed of one engine on its backends side by side: pt2 (AOTInductor), onnxruntime, eager torch (and
torchscript when built), in one process, alternating backend by backend on every prompt, warm-up excluded.

Greedy, batch 1, chat template when the engine has a tokenizer (prompts from ../shared/bench/prompts.jsonl,
the first --per-category of each category), else token-id prompts with repeats (tiny test engines). Modes:
target-only and speculative at the engine's largest k. Reports tokens/s per backend and mode, the ratio to
onnxruntime, and whether every backend gave the same tokens.

    specexport build --target smollm2 --dtype fp32 --format onnx,pt2 --greedy-only --k 4 --max-batch 1 \
        --max-seq-len 512 --out engines/pt2-smollm2
    python tools/pt2_bench.py engines/pt2-smollm2 --threads 2 --json bench-results/pt2.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specexport import SpeculativeDecoder  # noqa: E402

PROMPTS = ROOT.parent / "shared" / "bench" / "prompts.jsonl"


def load_prompts(dec, path: Path, per_category: int, limit: int) -> list[list[int]]:
    if dec.tokenizer is None or not path.is_file():  # token ids with repeats, so lookup finds drafts
        return [[(7 * i + j) % 50 + 1 for j in range(6)] * 3 for i in range(limit)]
    seen, rows = {}, []
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            if seen.setdefault(r["category"], 0) < per_category:
                seen[r["category"]] += 1
                rows.append(dec.encode(r["prompt"], chat=True))
    return rows[:limit]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine")
    ap.add_argument("--backends", default=None, help="default: pt2, onnxruntime, torch (+ torchscript if built)")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--limit", type=int, default=8, help="at most this many prompts")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=1, help="runs of every (prompt, mode, backend)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args()

    m = json.loads((Path(a.engine) / "manifest.json").read_text())
    formats = m.get("formats", ["onnx"])
    backends = a.backends.split(",") if a.backends else (
        [b for f, b in (("pt2", "pt2"), ("onnx", "onnxruntime")) if f in formats] + ["torch"]
        + (["torchscript"] if "torchscript" in formats else []))
    t0 = time.perf_counter()
    decs = {}
    for b in backends:
        t = time.perf_counter()
        decs[b] = SpeculativeDecoder.load(a.engine, backend=b, max_batch=1, threads=a.threads)
        print(f"loaded {b} in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    k = max(m["ks"])
    modes = {"target_only": dict(speculative=False), f"{m['drafter'] if m['drafter'] == 'prompt-lookup' else 'draft'}"
             f"@k{k}": dict(k=k)}
    prompts = load_prompts(next(iter(decs.values())), PROMPTS, a.per_category, a.limit)
    n = a.max_new_tokens
    for dec in decs.values():  # warm-up, excluded: one generation per mode and backend
        for kw in modes.values():
            dec.generate([prompts[0]], n, **kw)
    secs = {(mo, b): 0.0 for mo in modes for b in backends}
    toks = {(mo, b): 0 for mo in modes for b in backends}
    same = True
    for rep in range(a.reps):
        for i, p in enumerate(prompts):
            for mo, kw in modes.items():
                order = backends if (i + rep) % 2 == 0 else backends[::-1]  # alternate who goes first
                got = {}
                for b in order:
                    t = time.perf_counter()
                    out = decs[b].generate([p], n, **kw)[0]
                    secs[mo, b] += time.perf_counter() - t
                    toks[mo, b] += len(out.token_ids)
                    got[b] = out.token_ids
                same &= len({tuple(v) for v in got.values()}) == 1
    ref = "onnxruntime" if "onnxruntime" in backends else backends[0]
    rows = []
    for mo in modes:
        for b in backends:
            tps = toks[mo, b] / secs[mo, b]
            rows.append({"mode": mo, "backend": b, "tokens": toks[mo, b], "seconds": round(secs[mo, b], 3),
                         "tok_s": round(tps, 2), f"vs_{ref}": round(tps / (toks[mo, ref] / secs[mo, ref]), 3)})
    print(f"engine {a.engine} ({m['dtype']}, k {m['ks']}, drafter {m['drafter']}), {len(prompts)} prompts x "
          f"{n} new tokens x {a.reps} reps, batch 1, greedy, threads {a.threads or 'default'}; same tokens on every "
          f"backend: {same}")
    print(f"{'mode':<22}{'backend':<13}{'tok/s':>9}{'vs ' + ref:>18}")
    for r in rows:
        print(f"{r['mode']:<22}{r['backend']:<13}{r['tok_s']:>9.1f}{r[f'vs_{ref}']:>17.2f}x")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"engine": a.engine, "prompts": len(prompts), "max_new_tokens": n,
                                            "reps": a.reps, "threads": a.threads, "same_tokens": same,
                                            "rows": rows, "wall_s": round(time.perf_counter() - t0, 1)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
