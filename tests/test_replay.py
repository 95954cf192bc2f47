"""bench/replay.py: k="auto" replayed over recorded greedy outputs and proposals (tools/autok_replay.py)."""

import json
from collections import Counter

import numpy as np
import pytest

from specexport import SpeculativeDecoder
from specexport.bench.replay import Replay, _WidthTimer, record
from specexport.config import BuildConfig
from specexport.export.build import build

COSTS = {"verify": {"2": 1.1, "4": 1.2, "8": 1.4}, "draft": 0.4}


def _trace(prompts, model=None):
    return {"ks": [2, 4, 8], "costs": dict(COSTS),
            "prompts": [{"id": f"p{i}", "prompt": p, "out": o} | ({"model": model[i]} if model else {})
                        for i, (p, o) in enumerate(prompts)]}


def _tokens(steps):
    return sum(s.accepted + 1 for s in steps)


def test_nothing_matches_replays_as_target_only():
    out = list(range(100, 160))  # no token repeats: prompt lookup never proposes
    s = Replay(_trace([(list(range(1, 20)), out)]), "lookup").compare()
    row = s["rows"][0]
    assert row["auto"] == pytest.approx(1.0) and all(row[k] == pytest.approx(1.0) for k in (2, 4, 8))
    assert all(st.kd == 0 for st in row["steps"]) and _tokens(row["steps"]) == len(out) - 1


def test_noise_and_drift_are_measured_against_target_only_under_the_same_costs():
    """With noise and drift, a step that is a target-only step costs what target-only's own does at that position,
    so a prompt where nothing matches is still 1.0x; drift is one slow multiplier shared by every step kind."""
    out = list(range(100, 260))
    rp = Replay(_trace([(list(range(1, 20)), out)] * 2), "lookup", noise=0.1, drift=0.15, seed=3)
    s = rp.compare()
    assert all(r["auto"] == pytest.approx(1.0) and r[2] == pytest.approx(1.0) for r in s["rows"])
    x = rp.swings(4000, np.random.default_rng(0))
    assert abs(x.std() - 0.15) < 0.03  # its stationary spread
    assert np.corrcoef(x[:-1], x[1:])[0, 1] > 0.9  # slow: neighbouring positions move together


def test_a_copied_prompt_is_verified_wide_and_every_token_is_counted_once():
    text = list(range(1, 121))
    out = text[:]  # the output copies the prompt: lookup's 1-gram finds every next token
    rp = Replay(_trace([(text, out)] * 3), "lookup")
    s = rp.compare()
    for row in s["rows"]:
        assert _tokens(row["steps"]) == len(out) - 1
        assert row[8] > row[4] > row[2] > 1.0
    last = s["rows"][-1]
    assert last["auto"] > 0.9 * last[8]  # by the third request auto verifies at the widest k
    assert max(st.kd for st in last["steps"]) == 8


def test_a_draft_model_that_is_always_right_settles_on_its_best_k():
    out = list(range(100, 300))
    model = {str(i): out[i:i + 8] for i in range(len(out))}  # every proposal is the target's next 8 tokens
    s = Replay(_trace([(list(range(1, 10)), out)] * 3, [model] * 3), "model").compare()
    best = max((2, 4, 8), key=lambda k: (k + 1) / (k * COSTS["draft"] + COSTS["verify"][str(k)]))
    assert max(s["fixed"], key=s["fixed"].get) == best
    assert s["rows"][-1]["auto"] > 0.95 * s["rows"][-1][best]


def test_record_matches_the_runtime_and_replays_every_kind(engines, tmp_path):
    """The trace's outputs are the engine's target-only tokens, and a fixed-k replay of the draft model or of prompt
    lookup takes the steps a real decode at that k takes (greedy: the same proposals at the same positions), but
    for the last one, where the real verify may accept past the request's end."""
    path = engines["llama"]
    prompts = [{"id": "a", "prompt": [3, 17, 5, 9, 11]}, {"id": "b", "prompt": [8, 8, 2, 40, 6, 7, 1, 8, 8, 2, 40]}]
    trace = record(path, prompts, max_new_tokens=20, chat=False, log=lambda *a: None)
    json.dumps(trace)  # (it is written as json)
    assert trace["ks"] == [1, 3] and set(trace["costs"]) >= {"verify", "draft"}
    assert set(trace["costs"]["verify"]) == {"1", "3"} and min(trace["costs"]["verify"].values()) > 0  # timed in-loop
    assert trace["drafter"]["min_match"] >= 1 and trace["drafter"]["ngram_max"] >= trace["drafter"]["ngram_min"]
    for kind, drafter in (("model", "model"), ("lookup", "prompt-lookup")):
        dec = SpeculativeDecoder.load(path, max_batch=1, drafter=drafter)
        for p, t in zip(prompts, trace["prompts"]):
            base = dec.generate(p["prompt"], max_new_tokens=20, speculative=False)[0]
            assert t["out"] == base.token_ids
            for k in (1, 3):
                real = dec.generate(p["prompt"], max_new_tokens=20, speculative=True, k=k)[0].stats
                rate, steps = Replay(trace, kind).run(t, k)
                assert len(steps) == real.steps and _tokens(steps) == len(t["out"]) - 1
                want = Counter({n: c for n, c in enumerate(real.accept_hist) if c})
                got = Counter(s.accepted for s in steps)
                assert sum((want - got).values()) <= 1 and sum((got - want).values()) <= 1, (kind, k, want, got)
    for kind in ("lookup", "model", "hybrid"):
        s = Replay(trace, kind).compare()
        assert s["min_auto"] > 0 and set(s["fixed"]) == {1, 3}


def test_the_hybrid_replays_the_models_handover_to_lookup():
    """As drafters.HybridDrafter does over the target's cache (`shares_kv`): the model's drafts "101 1 2" complete a
    2-gram match of the prompt after 3 passes, and lookup proposes the other 5 of k = 8."""
    passage = list(range(1, 41))
    out = [100, 101] + passage[:30]  # the text returns to the passage after one new token
    model = {str(i): (out[i:] + [0] * 8)[:8] for i in range(len(out))}  # the draft is always right
    trace = _trace([(passage, out)], [model]) | {"drafter": {"min_match": 2, "shares_kv": True}}
    (on, on_steps), (off, off_steps) = (Replay(trace, "hybrid", handover=h).run(trace["prompts"][0], 8)
                                        for h in (True, False))
    assert (on_steps[0].passes, on_steps[0].proposed, on_steps[0].accepted) == (3, 8, 8)
    assert (off_steps[0].passes, off_steps[0].accepted) == (8, 8)
    assert _tokens(on_steps) == _tokens(off_steps) == len(out) - 1 and on > off
    assert Replay(trace | {"drafter": {"min_match": 2, "shares_kv": False}}, "hybrid").run(
        trace["prompts"][0], 8)[1][0].passes == 8  # a draft with its own cache drafts all k
    r = Replay(trace, "hybrid")  # the rule (AutoK.handover_pays) refuses: the model drafts on, as the drafter does
    seq, md = trace["prompts"][0]["prompt"] + out[:1], model["1"]
    assert r.chain(seq, md, None, 8, lambda j, s, n: False)[1:3] == (8, None)
    assert r.chain(seq, md, None, 8, lambda j, s, n: True)[1:3] == (3, (3, 2))


def test_the_replay_ends_a_models_chain_at_a_near_tie():
    """As drafters.ModelDrafter does with min_margin: a recorded margin under it ends the chain after that draft
    (which is still proposed); 0 turns it off; auto is shown the ties it met."""
    out = list(range(100, 140))
    model = {str(i): (out[i:] + [0] * 8)[:8] for i in range(len(out))}  # the draft is always right
    margin = {str(i): [5.0, 5.0, 0.1, 5.0, 5.0, 5.0, 5.0] for i in range(len(out))}  # its third draft is a tie
    trace = _trace([(list(range(1, 20)), out)], [model])
    trace["prompts"][0]["margin"] = margin
    trace["drafter"] = {"min_margin": 0.15, "shares_kv": True}
    steps = Replay(trace, "model").run(trace["prompts"][0], 8)[1]
    assert (steps[0].passes, steps[0].proposed, steps[0].accepted, steps[0].kd) == (3, 3, 3, 4)
    off = Replay(trace, "model", min_margin=0).run(trace["prompts"][0], 8)[1]
    assert (off[0].passes, off[0].proposed) == (8, 8)
    r = Replay(trace, "model")
    auto = r.controller()
    r.run(trace["prompts"][0], "auto", auto)
    assert auto.ties[0] / auto.ties[1] == pytest.approx(1 / 3, abs=0.05)  # (its probes at k = 2 check one, no tie)


def test_timing_the_verify_widths_changes_no_token_or_proposal(tiny, tmp_path, monkeypatch):
    """record's in-loop verify calls (every step here) leave the trace as an untimed recording makes it: outputs,
    the draft's proposals and margins, exactly; for a draft that runs over the target's cache (a quantized copy)."""
    path = build(BuildConfig(target=tiny["llama"]["target"], draft="quant:int8", ks=(1, 3), sampling=False,
                             max_seq_len=96, max_batch=1, prefill_chunk=16, out=str(tmp_path / "e")),
                 progress=False)["out"]
    prompts = [{"id": "a", "prompt": [3, 17, 5, 9, 11]}, {"id": "b", "prompt": [8, 8, 2, 40, 6, 7, 1, 8, 8, 2, 40]}]
    monkeypatch.setattr(_WidthTimer, "every", 1)
    timed = record(path, prompts, max_new_tokens=24, chat=False, log=lambda *a: None)
    assert timed["drafter"]["shares_kv"] and min(timed["costs"]["verify"].values()) > 0
    monkeypatch.setattr(_WidthTimer, "maybe_time", lambda self, current, past_len: None)
    monkeypatch.setattr(_WidthTimer, "costs", lambda self: ({str(k): 1.0 for k in self.ks}, 1.0))
    untimed = record(path, prompts, max_new_tokens=24, chat=False, log=lambda *a: None)
    assert timed["prompts"] == untimed["prompts"]
