#!/usr/bin/env python
"""A draft model's chains per draft position, at fixed k: how often a near-tie ends the chain (the margin stop,
drafters.ModelDrafter), how often the tie's draft and the clear drafts are accepted, and the tokens per step that
AutoK.model_tokens promises with acceptance in two classes (`split_ties`) and with one pooled acceptance, against
the tokens the steps committed. Greedy, batch 1, chat template; the decoder runs alone (no timing).

    python tools/chain_positions.py engines/bench/se-fp32-int8 --ks 8,4,2

Stop 47 (the int8 copy of fp32 SmolLM2, 24 prompts, 128 tokens): ties at 3.6% of the positions reached, the tie's
draft accepted about 0.6 of the time, the clear drafts 0.98-0.996; two classes promise 2.91, 4.64, 7.67 tokens a
step at k = 2, 4, 8 where the steps committed 2.92, 4.62, 7.71; one pooled acceptance 2.89, 4.57, 7.37.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import ab_prompts  # noqa: E402
from specexport.autok import AutoK  # noqa: E402
from specexport.runtime import SpeculativeDecoder  # noqa: E402


def record(dec) -> list[tuple[int, int, bool]]:
    """Wrap the decoder's drafter and target: each verify with drafts appends (proposed, accepted, tied) of row 0."""
    log, cur = [], {}
    propose, verify = dec.drafter.propose, dec.target.verify

    def proposing(x, k, *a, **kw):
        p = propose(x, k, *a, **kw)
        cur["L"], cur["tied"] = int(p.draft_len[0]), p.tied is not None and bool(p.tied[0])
        return p

    def verifying(tokens, draft_len, past_len, kv_len, k, *a):
        out = verify(tokens, draft_len, past_len, kv_len, k, *a)
        if k > 0:
            log.append((cur["L"], int(out[0][0]), cur["tied"]))
        return out

    dec.drafter.propose, dec.target.verify = proposing, verifying
    return log


def summarize(log: list[tuple[int, int, bool]], k: int) -> dict:
    """Per position i (1..k): reached (drafted, every draft before it accepted), ties (the chain's last, a near-tie),
    and acceptance of the tie's draft and of the clear ones; pooled over positions too (t over every position
    checked, as AutoK.observe_ties counts them)."""
    rows = []
    for i in range(1, k + 1):
        reach = [(L, n, t) for L, n, t in log if L >= i and n >= i - 1]
        tie = [n >= i for L, n, t in reach if t and L == i]
        clear = [n >= i for L, n, t in reach if not (t and L == i)]
        rows.append((i, len(reach), len(tie), sum(tie), len(clear), sum(clear)))
    ties = sum(t for _, _, t in log)  # per position checked, as AutoK counts them: a tied chain checked all of
    checked = sum(L if t else min(L, k - 1) for L, _, t in log)  # its drafts, a full one all but its k-th
    return {"rows": rows, "t": ties / max(checked, 1), "a_tie": sum(r[3] for r in rows) / max(ties, 1),
            "a": sum(r[5] for r in rows) / max(sum(r[4] for r in rows), 1),  # (as observe_chain counts them)
            "tokens": 1 + sum(n for _, n, _ in log) / max(len(log), 1)}


def promised(t: float, a: float, a_tie: float, k: int) -> tuple[float, float]:
    """AutoK.model_tokens at these rates: (two classes, one pooled acceptance)."""
    out = []
    for split in (True, False):
        ctl = AutoK((k,), free_drafts=False, split_ties=split, ties=[t * 1000, 1000.0])
        ctl.tie_acc.accepted, ctl.tie_acc.rejected = a_tie * 1000, (1 - a_tie) * 1000
        out.append(ctl.model_tokens(a if split else (1 - t) * a + t * a_tie, k))
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ab_prompts.add_args(ap)
    ap.add_argument("--ks", default="8,4,2", help="the fixed ks to run, comma-separated (built ones)")
    a = ap.parse_args()
    dec = SpeculativeDecoder.load(a.engine, **(ab_prompts.load_opts(a) | {"drafter": "model"}))
    log = record(dec)
    prompts = ab_prompts.read(a)
    for k in (int(x) for x in a.ks.split(",")):
        log.clear()
        for p in prompts:
            dec.generate(p["prompt"], max_new_tokens=a.max_new_tokens, chat=True, k=k)
        if not log:
            sys.exit("error: no speculative step ran: is the engine built with a draft model and this k?")
        s = summarize(log, k)
        print(f"k = {k}: {len(log)} steps, {s['tokens']:.2f} tokens a step; tie rate {s['t']:.3f} per position "
              f"checked, tie's draft accepted {s['a_tie']:.3f}, clear drafts {s['a']:.3f}")
        for i, reach, ties, tie_acc, clear, clear_acc in s["rows"]:
            print(f"  position {i}: reached {reach}, ties {ties} ({ties / max(reach, 1):.3f}, accepted "
                  f"{tie_acc / max(ties, 1):.3f}), clear accepted {clear_acc / max(clear, 1):.3f}")
        two, one = promised(s["t"], s["a"], s["a_tie"], k)
        print(f"  promised tokens a step: two classes {two:.2f}, one pooled acceptance {one:.2f}; "
              f"committed {s['tokens']:.2f}")


if __name__ == "__main__":
    main()
