"""tools/chain_positions.py: a draft model's chains per draft position (ties, acceptance in two classes)."""

import pytest
from helpers import load_tool

from specexport.runtime import SpeculativeDecoder


def test_positions_split_ties_from_clear_drafts():
    tool = load_tool("chain_positions")
    # (proposed, accepted, tied): all 4 accepted; a tie at 2, rejected; a tie at 3, accepted; 1 of 4 accepted
    s = tool.summarize([(4, 4, False), (2, 1, True), (3, 3, True), (4, 1, False)], 4)
    assert [r[:3] for r in s["rows"]] == [(1, 4, 0), (2, 4, 1), (3, 2, 1), (4, 1, 0)]  # (position, reached, ties)
    assert s["a_tie"] == 0.5 and s["t"] == pytest.approx(2 / 11)  # ties over the positions checked: 3 + 2 + 3 + 3
    assert s["a"] == pytest.approx(8 / 9) and s["tokens"] == pytest.approx(1 + 9 / 4)
    two, one = tool.promised(0.1, 0.9, 0.9, 4)  # a tie accepted like any draft: the two rules agree
    assert two == pytest.approx(one, rel=1e-3)  # (a_tie carries a pseudo-trial at 0.5)
    two, one = tool.promised(0.1, 0.99, 0.5, 8)
    assert two > one  # clear drafts at 0.99: one pooled acceptance undersells a long chain


def test_record_logs_every_verified_chain(texty_engine):
    tool = load_tool("chain_positions")
    dec = SpeculativeDecoder.load(texty_engine, threads=2, max_batch=1, drafter="model")
    log = tool.record(dec)
    ref = dec.generate("w3 w4 w5 w3 w4", max_new_tokens=12, speculative=False)[0]
    out = dec.generate("w3 w4 w5 w3 w4", max_new_tokens=12, k=3)[0]
    assert out.token_ids == ref.token_ids and log
    assert all(0 <= n <= L <= 3 for L, n, _ in log)
    assert sum(n + 1 for _, n, _ in log) <= len(out.token_ids)
