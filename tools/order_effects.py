#!/usr/bin/env python
"""Carry-over between systems in a `bench --peers` run (versus.json from a run that records its orders): each run's
decode rate over the same system's geometric mean on that prompt, grouped by the system that ran just before it.
An effect far from 1.00x means that system leaves the machine in a state (cores spinning, caches) that slows or
speeds whatever follows it.

    python tools/order_effects.py bench-results/s51-versus/versus.json [--system se-fp32/target-only ...]
"""

from __future__ import annotations

import argparse
import collections
import json
import math


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("versus_json")
    ap.add_argument("--system", action="append", default=[], help="also each predecessor's effect on this system")
    a = ap.parse_args()
    recs = json.load(open(a.versus_json))["result"]["records"]
    if not recs or "order" not in recs[0]:
        raise SystemExit(f"{a.versus_json}: its runs record no order (a run before the orders were recorded)")

    def log_rate(rec, name):
        return math.log(max(rec["systems"][name]["decode_tokens_per_s"], 1e-9))
    logs = collections.defaultdict(list)
    for rec in recs:
        for name in rec["systems"]:
            logs[(rec["id"], name)].append(log_rate(rec, name))
    mean = {key: sum(v) / len(v) for key, v in logs.items()}
    after, pair, last = collections.defaultdict(list), collections.defaultdict(list), None
    for rec in recs:
        order = rec["order"]
        for j, name in enumerate(order):
            before = order[j - 1] if j else last
            if before is not None:
                effect = log_rate(rec, name) - mean[(rec["id"], name)]
                after[before].append(effect)
                pair[(name, before)].append(effect)
        last = order[-1]
    gm = lambda v: math.exp(sum(v) / len(v))  # noqa: E731
    print("the follower's decode rate over its mean on that prompt, by the system that ran just before it:")
    for before, v in sorted(after.items(), key=lambda kv: gm(kv[1])):
        print(f"  after {before:32s} {gm(v):.3f}x  ({len(v)} runs)")
    for name in a.system:
        print(f"{name}, by predecessor:")
        for (n, before), v in sorted(pair.items(), key=lambda kv: gm(kv[1])):
            if n == name:
                print(f"  after {before:32s} {gm(v):.3f}x  ({len(v)} runs)")


if __name__ == "__main__":
    main()
