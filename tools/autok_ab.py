#!/usr/bin/env python
"""`k="auto"` with changed AutoK fields (specexport/autok) against the default, side by side in real runs: two decoders
over one engine in one process; on every prompt, before the next, target-only, auto (default), auto (changed)
and a fixed k (the order of the two autos alternating per repetition), warm-up excluded. Greedy, batch 1, chat
template, the prompts of ../shared/bench/prompts.jsonl. Prints each prompt's ratios, then per category and
overall the geometric means of the per-prompt medians over target-only, the changed / default ratio, and whether
every mode gave the same tokens. The replay (tools/autok_replay.py --set) compares rules without the noise; this
checks the result on the machine.

    python tools/autok_ab.py engines/bench/se-fp32-int8 --set whole_matches=false --reps 2
    python tools/autok_ab.py engines/bench/se-fp32-int8 --set whole_matches=false --no-prepack --fixed-k 8
    python tools/autok_ab.py engines/bench/se-fp32-int8 --drafter prompt-lookup --set z_by_stake=false --reps 3
    python tools/autok_ab.py engines/bench/se-fp32-int8 --drafter-set handover=false --fixed-k 0 --reps 2
    python tools/autok_ab.py engines/bench/se-fp32-int8 --drafter-set lookup.context_max=3 --fixed-k 0
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
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="an AutoK field of the changed decoder (a path such as costs.keep; repeatable)")
    ap.add_argument("--drafter-set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a field of the changed decoder's drafter (drafters.py; the hybrid's lookup as "
                         "lookup.FIELD; repeatable)")
    ap.add_argument("--fixed-k", type=int, default=8, help="the fixed k run alongside (0: none)")
    a = ap.parse_args()
    opts = ab_prompts.load_opts(a)
    default, changed = SpeculativeDecoder.load(a.engine, **opts), SpeculativeDecoder.load(a.engine, **opts)
    for s in a.drafter_set:  # (drafters.py)
        path, _, val = s.partition("=")
        ab_prompts.set_field(changed.drafter, path, val, f"--drafter-set {s}")
    ctl = changed.autok()  # (after the drafter's fields: AutoK reads some of them, e.g. its handover)
    for s in a.set:  # (specexport/autok)
        key, _, val = s.partition("=")
        ab_prompts.set_field(ctl, key, val, f"--set {s}")
    prompts = ab_prompts.read(a)
    ab_prompts.warm_up((default, changed), prompts)
    modes = [("default", default, dict(k="auto")), ("changed", changed, dict(k="auto"))]
    if a.fixed_k:
        modes.append((f"k{a.fixed_k}", default, dict(k=a.fixed_k)))
    res = {}
    for rep in range(a.reps):
        for p in prompts:
            r = res.setdefault(p["id"], {"cat": p.get("category", ""), "same": True, "t": []} | {m: [] for m, *_ in modes})
            order = modes if rep % 2 == 0 else [modes[1], modes[0], *modes[2:]]
            base = default.generate(p["prompt"], max_new_tokens=a.max_new_tokens, chat=True, speculative=False)[0]
            r["t"].append(base.stats.decode_rate)
            for m, d, kw in order:
                o = d.generate(p["prompt"], max_new_tokens=a.max_new_tokens, chat=True, **kw)[0]
                r[m].append(o.stats.decode_rate)
                r["same"] &= o.token_ids == base.token_ids
            print(p["id"], " ".join(f"{m} {r[m][-1] / r['t'][-1]:.3f}" for m, *_ in modes), flush=True)

    g = geomean
    def med(r, x, y):
        return float(np.median(np.array(r[x]) / np.array(r[y])))

    cats = sorted({r["cat"] for r in res.values()})
    print(f"{'mode':9s} {'all':>6s} {'lowest':>6s} " + " ".join(f"{c:>9s}" for c in cats) + "   (x target-only)")
    for m, *_ in modes:
        per = [med(r, m, "t") for r in res.values()]
        print(f"{m:9s} {g(per):6.3f} {min(per):6.3f} " +
              " ".join(f"{g([med(r, m, 't') for r in res.values() if r['cat'] == c]):9.3f}" for c in cats))
    print(f"changed / default {g([med(r, 'changed', 'default') for r in res.values()]):.3f}; target-only "
          f"{g([np.median(r['t']) for r in res.values()]):.1f} tok/s; every mode gave target-only's tokens on "
          f"{sum(r['same'] for r in res.values())}/{len(res)} prompts")


if __name__ == "__main__":
    main()
