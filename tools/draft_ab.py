#!/usr/bin/env python
"""Engines that share a target but differ in their draft, side by side: every engine loaded in one process, on
every prompt before the next (the engines' order flips per prompt and repetition), warm-up excluded.

Greedy, batch 1, chat template, the 24 prompts of ../shared/bench/prompts.jsonl. Modes: `auto` (the engine's
default drafter at k="auto": the hybrid for an engine with a draft model) and `m<k>` (the draft model alone at
k). Reports, per mode and engine, the geometric mean over prompts of decode tokens/s (each prompt's median over
repetitions), its ratio to the first engine's, the acceptance MLE, and the draft pass and verify costs auto
measured (ms; auto only). Tokens are checked against the first engine's target-only tokens.

    specexport build --draft quant:int8:b128:asym --k 2,4,8 --max-seq-len 1024 --greedy-only --dtype fp32 \
        --max-batch 1 --out engines/bench/fp32-int8-b128a            # (and one per draft to compare)
    python tools/draft_ab.py engines/bench/se-fp32-int8,engines/bench/fp32-int8-b128a --reps 2 --modes auto,m8
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specexport import SpeculativeDecoder  # noqa: E402
from specexport.bench.report import geomean  # noqa: E402

PROMPTS = ROOT.parent / "shared" / "bench" / "prompts.jsonl"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("engines", help="comma-separated engine folders (the first is the reference)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--modes", default="auto,m8", help="auto and/or m<k> (the draft model alone at k)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts", default=str(PROMPTS))
    a = ap.parse_args(argv)
    engines, modes = a.engines.split(","), a.modes.split(",")
    prompts = [json.loads(line) for line in open(a.prompts) if line.strip()]
    load = lambda e, **kw: SpeculativeDecoder.load(e, prepack=True, max_batch=1, **kw)  # noqa: E731
    decs = {"auto": [load(e) for e in engines]}
    for m in modes:
        if m != "auto":
            decs[m] = decs.get(m) or [load(e, drafter="model") for e in engines]
    runs = {"auto": dict(k="auto")} | {m: dict(k=int(m[1:])) for m in modes if m != "auto"}
    for m in modes:  # warm-up: sessions, first samples of every cost
        for d in decs[m]:
            d.generate(d.encode(prompts[0]["prompt"], chat=True), 32, **runs[m])
    res = {(m, j): {"rate": {}, "acc": 0, "rej": 0, "same": 0, "n": 0} for m in modes for j in range(len(engines))}
    for rep in range(a.reps):
        for i, p in enumerate(prompts):
            ids = decs["auto"][0].encode(p["prompt"], chat=True)
            want = decs["auto"][0].generate(ids, a.max_new_tokens, speculative=False)[0].token_ids
            for m in modes:
                order = list(range(len(engines)))[:: -1 if (i + rep) % 2 else 1]
                for j in order:
                    o = decs[m][j].generate(ids, a.max_new_tokens, **runs[m])[0]
                    r = res[(m, j)]
                    if o.stats.decode_rate > 0:  # (none when it stopped at the first token)
                        r["rate"].setdefault(p["id"], []).append(o.stats.decode_rate)
                    r["acc"] += o.stats.accepted
                    r["rej"] += o.stats.rejected
                    r["same"] += o.token_ids == want
                    r["n"] += 1
    cats = {p["id"]: p["category"] for p in prompts}
    for m in modes:
        ref = res[(m, 0)]["rate"]
        for j, e in enumerate(engines):
            r = res[(m, j)]
            rate = geomean(median(v) for v in r["rate"].values())
            ratio = geomean(median(r["rate"][k]) / median(ref[k]) for k in ref if k in r["rate"])
            costs = {f"{kind}{n}": round(v * 1e3, 2) for (kind, n, b), v in decs[m][j].autok().costs.median.items()
                     if b == 1 and kind in ("verify", "draft")}
            print(f"{m:5s} {e}: {rate:.1f} tok/s, x{ratio:.3f} the first, acceptance MLE "
                  f"{r['acc'] / max(r['acc'] + r['rej'], 1):.3f}, tokens = target-only {r['same']}/{r['n']}"
                  + (f", costs auto measured (ms) {costs}" if costs else ""))
            if j:  # per category: the geometric mean of the per-prompt ratios to the first engine
                per = {c: geomean(median(r["rate"][k]) / median(ref[k]) for k in ref if k in r["rate"] and
                                  cats[k] == c) for c in sorted(set(cats.values()))}
                print("      per category, x the first: " + ", ".join(f"{c} {v:.3f}" for c, v in per.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
