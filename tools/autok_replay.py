#!/usr/bin/env python
"""Compare `k="auto"` rules without the machine's noise: record an engine's greedy outputs, draft proposals and
step costs once, then replay auto and every fixed k over them (specexport/bench/replay.py says why that is exact
at greedy and what it does not model).

    python tools/autok_replay.py record engines/bench/se-fp32-int8 --out traces/fp32-int8.json [--no-prepack]
    python tools/autok_replay.py replay traces/fp32-int8.json --kind hybrid [--noise 0.1 --seeds 5] \
        [--set z=0.25 --set margin=0.1] [-v]

`replay` prints, per kind: the lowest prompt's auto / target-only, the geometric means of auto and each fixed k
over target-only, and auto against the best fixed k per prompt (chosen in hindsight) and against the best single
fixed k. With --noise, every step's cost is multiplied by 1 + noise x N(0, 1), over --seeds seeds (means and the
worst seed's minimum); --drift adds the machine's slow swings (one multiplier shared by every step kind, a random
walk of that standard deviation in log cost). Target-only, the reference, meets the same costs. --set overrides an
AutoK field (specexport/autok) for the replay.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specexport.bench.replay import KINDS, Replay, record  # noqa: E402

PROMPTS = ROOT.parent / "shared" / "bench" / "prompts.jsonl"


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="an engine's trace: greedy outputs, draft proposals, step costs")
    r.add_argument("engine")
    r.add_argument("--out", required=True)
    r.add_argument("--prompts", default=str(PROMPTS))
    r.add_argument("--max-new-tokens", type=int, default=128)
    r.add_argument("--prepack", action=argparse.BooleanOptionalAction, default=None)
    r.add_argument("--threads", type=int, default=None)
    p = sub.add_parser("replay", help="auto and every fixed k over a trace")
    p.add_argument("trace")
    p.add_argument("--kind", default=None, help=f"one of {', '.join(KINDS)} (default: every kind the trace holds)")
    p.add_argument("--noise", type=float, default=0.0)
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--drift", type=float, default=0.0,
                   help="the machine's slow swings: sd of the log cost multiplier shared by every step kind")
    p.add_argument("--drift-steps", type=float, default=32.0, help="the swings' correlation length, in positions")
    p.add_argument("--switch", type=float, default=0.0, help="extra cost (x c0) of a target-only step after a verify")
    p.add_argument("--costs", default=None, metavar="JSON",
                   help='replace cost entries of the trace, e.g. '
                        '\'{"verify": {"2": 1.98, "4": 2.05, "8": 2.3}, "draft": 0.42}\'')
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="an AutoK field for the replay")
    p.add_argument("--min-margin", type=float, default=None,
                   help="the model's margin stop (drafters.ModelDrafter; default: the recording's; 0: off)")
    p.add_argument("-v", "--verbose", action="store_true", help="per-prompt ratios and auto's steps")
    a = ap.parse_args(argv)
    if a.cmd == "record":
        from specexport.bench.runner import read_prompts  # (torch: only to record)
        trace = record(a.engine, read_prompts(a.prompts), a.max_new_tokens, a.prepack, a.threads)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(trace))
        print(f"trace written to {a.out}")
        return 0
    trace = json.loads(Path(a.trace).read_text())
    if a.costs:  # per entry: {"verify": {"8": 2.3}} changes c(8) only
        for key, val in json.loads(a.costs).items():
            if isinstance(val, dict):
                trace["costs"].setdefault(key, {}).update(val)
            else:
                trace["costs"][key] = val
    overrides = {}
    for s in a.set:
        key, _, val = s.partition("=")
        overrides[key] = _value(val)
    kinds = [a.kind] if a.kind else [k for k in KINDS if k == "lookup" or "draft" in trace["costs"]]
    for kind in kinds:
        runs = [Replay(trace, kind, noise=a.noise, drift=a.drift, drift_steps=a.drift_steps, switch=a.switch, seed=s,
                       min_margin=a.min_margin)
                .compare(**overrides) for s in range(a.seeds)]
        mean = lambda key: sum(x[key] for x in runs) / len(runs)  # noqa: E731
        fixed = "  ".join(f"k{k} {sum(x['fixed'][k] for x in runs) / len(runs):.3f}" for k in runs[0]["fixed"])
        print(f"{kind:7s} auto / target-only: lowest prompt {mean('min_auto'):.3f} (worst seed "
              f"{min(x['min_auto'] for x in runs):.3f}, {runs[0]['worst']}), geomean {mean('auto'):.3f} | fixed: "
              f"{fixed} | auto / best fixed k per prompt {mean('auto_vs_best'):.3f}, / best single k "
              f"(k{runs[0]['single_k']}) {mean('auto_vs_single'):.3f}")
        if a.verbose:
            for row in runs[0]["rows"]:
                ks = "  ".join(f"k{k} {row[k]:.3f}" for k in runs[0]["fixed"])
                steps = " ".join((f"m{s.passes}:" if s.passes else "") + (f"{s.kd}:{s.accepted}" if s.kd else ".")
                                 for s in row["steps"])
                print(f"  {row['id']:16s} auto {row['auto']:.3f}  {ks}   {steps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
