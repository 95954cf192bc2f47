"""Adaptive k (autok.py) with hand-forced costs and acceptance, and k="auto" / forced k sequences in the
runtime: the tokens stay the target's, and a draft model catches up after target-only steps."""

import pytest

from specexport import SpeculativeDecoder
from specexport.autok import AutoK, RowAcceptance, acceptance_mle, expected_tokens


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0, 4) == pytest.approx(5.0, rel=0.01)  # a is capped just below 1
    assert expected_tokens(0.9, 0) == 1.0
    assert acceptance_mle(9, 1) == 0.9 and acceptance_mle(0, 0) == 0.0


def _measured(ctl: AutoK, B: int, costs: dict[int, float]) -> None:
    for k, c in costs.items():
        for _ in range(2):  # the first sample is set-up, the second starts the average
            assert ctl.choose(B, []) == k  # untried options first
            ctl.observe_cost(k, B, c)


def _row(a: float, n: int = 100) -> RowAcceptance:
    return RowAcceptance(accepted=a * n, rejected=(1 - a) * n)


def test_picks_the_highest_expected_rate():
    ctl = AutoK((2, 4, 8))
    _measured(ctl, 1, {0: 1.0, 2: 1.4, 4: 1.8, 8: 2.6})
    # rate(k) = E(a, k) / cost(k)
    for a in (0.0, 0.3, 0.6, 0.8, 0.95):
        rows = [_row(a)]
        want = max((0, 2, 4, 8), key=lambda k: expected_tokens(ctl.acceptance(rows[0]), k) / ctl.costs[(k, 1)])
        assert ctl.choose(1, rows) == want
    assert ctl.choose(1, [_row(0.0)]) == 0  # speculation off when nothing is accepted
    assert ctl.choose(1, [_row(0.95)]) == 8


def test_turns_speculation_off_at_a_large_batch():
    """At batch 8 the verify pass is no longer almost free: the same acceptance then prefers target-only."""
    ctl = AutoK((4,))
    _measured(ctl, 1, {0: 1.0, 4: 1.6})
    _measured(ctl, 8, {0: 2.0, 4: 9.0})
    rows = [_row(0.5) for _ in range(8)]
    assert ctl.choose(1, rows[:1]) == 4
    assert ctl.choose(8, rows) == 0


def test_costs_follow_a_moving_average_and_stale_options_are_remeasured():
    ctl = AutoK((4,), explore_every=5)
    _measured(ctl, 1, {0: 1.0, 4: 1.2})
    ctl.observe_cost(4, 1, 2.2)
    assert ctl.costs[(4, 1)] == pytest.approx(0.7 * 1.2 + 0.3 * 2.2)
    picks = [ctl.choose(1, [_row(0.9)]) for _ in range(10)]
    assert 0 in picks and 4 in picks  # mostly 4, with a periodic re-measurement of 0


def test_a_new_request_starts_from_the_running_estimate():
    ctl = AutoK((4,))
    for _ in range(50):
        ctl.observe_acceptance(RowAcceptance(), 4, 4)  # other requests: everything accepted
    fresh = RowAcceptance()
    assert ctl.acceptance(fresh) > 0.9
    row = RowAcceptance()
    for _ in range(30):
        ctl.observe_acceptance(row, 0, 4)  # this request: nothing accepted
    assert ctl.acceptance(row) < 0.3  # (decayed counts: the prior still weighs a little)


def test_a_request_that_stopped_drafting_is_tried_again():
    ctl = AutoK((4,))
    _measured(ctl, 1, {0: 1.0, 4: 1.5})
    for _ in range(50):
        ctl.observe_acceptance(RowAcceptance(), 3, 4)  # the running estimate: drafting pays
    row = RowAcceptance()
    for _ in range(10):
        ctl.observe_acceptance(row, 0, 4)  # a bad patch for this request
    assert ctl.choose(1, [row]) == 0
    picks = []
    for _ in range(30):  # target-only steps teach nothing about acceptance; the estimate relaxes to the prior
        k = ctl.choose(1, [row])
        picks.append(k)
        ctl.observe_acceptance(row, 0, 0) if k == 0 else None
    assert picks[-1] == 4


def test_auto_greedy_equals_transformers(tiny):
    import torch
    t = tiny["llama"]
    dec = SpeculativeDecoder.from_pretrained(t["target"], t["perturbed"], k=4, max_seq_len=96, max_batch=3)
    prompts = [[1, 5, 9, 2], [3] * 11, list(range(20, 50))]
    outs = dec.generate(prompts, max_new_tokens=24, k="auto")
    for p, o in zip(prompts, outs):
        x = torch.tensor([p])
        want = t["hf"].generate(x, attention_mask=torch.ones_like(x), max_new_tokens=24, do_sample=False)
        assert o.token_ids == want[0, len(p):].tolist()
        assert o.stats.k == "auto" and sum(o.stats.k_steps.values()) == o.stats.steps
    import numpy as np
    o = dec.generate(prompts[0], max_new_tokens=8, k=np.int64(2))[0]  # a numpy k is that k, not the largest
    assert set(o.stats.k_steps) == {2}


def test_draft_model_catches_up_after_target_only_steps(tiny):
    """An identical draft accepts everything only if its cache holds every committed token: force a k sequence
    with target-only steps in between and check that no draft is ever rejected."""
    t = tiny["qwen2"]
    dec = SpeculativeDecoder.from_pretrained(t["target"], t["same"], k=4, max_seq_len=128, max_batch=2,
                                             prefill_chunk=8)
    ref = dec.generate([[4, 8, 15, 16, 23, 42], [7] * 13], max_new_tokens=40, speculative=False)
    seq = iter([0, 0, 0, 4, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 4] * 10)
    dec.autok().choose = lambda B, rows: next(seq)
    outs = dec.generate([[4, 8, 15, 16, 23, 42], [7] * 13], max_new_tokens=40, k="auto")
    for o, r in zip(outs, ref):
        assert o.token_ids == r.token_ids
        assert o.stats.k_steps.get(0, 0) > 0 and o.stats.drafted > 0
        assert o.stats.accepted == o.stats.drafted and o.stats.rejected == 0
