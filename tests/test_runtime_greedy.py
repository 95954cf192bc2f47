"""Greedy speculative output == target-only greedy == transformers generate(do_sample=False), token for token."""

import pytest
import torch

from helpers import FAMILIES, hf_greedy
from specexport import SpeculativeDecoder

PROMPTS = [[5, 17, 3, 88, 41], [7] * 3 + list(range(20, 34)), [int(x) for x in torch.randint(0, 96, (70,),
                                                                      generator=torch.Generator().manual_seed(3))]]
NEW = 24
DRAFTS = ("same", "unrelated", "perturbed", "prompt-lookup", "hybrid")


@pytest.fixture(scope="module")
def hf_reference(tiny):
    out = {}
    for fam in FAMILIES:
        hf = tiny[fam]["hf"]
        out[fam] = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    return out


@pytest.mark.parametrize("draft", DRAFTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_equals_target_only_and_transformers(tiny, hf_reference, family, draft):
    spec = {"prompt-lookup": "prompt-lookup", "hybrid": "prompt-lookup+" + tiny[family]["perturbed"]}.get(
        draft) or tiny[family][draft]
    dec = SpeculativeDecoder.from_pretrained(tiny[family]["target"], spec, k=5, max_seq_len=128, max_batch=4,
                                             prefill_chunk=16)
    baseline = [o.token_ids for o in dec.generate(PROMPTS, max_new_tokens=NEW, speculative=False)]
    assert baseline == hf_reference[family]
    rates = []
    for k in (1, 3, 5):
        outs = dec.generate(PROMPTS, max_new_tokens=NEW, k=k)
        assert [o.token_ids for o in outs] == hf_reference[family], f"k={k}"
        for o in outs:
            st = o.stats
            assert st.new_tokens == NEW and len(st.accept_hist) == k + 1 and sum(st.accept_hist) == st.steps
            assert NEW - 1 <= st.steps + st.accepted <= NEW - 1 + k  # first token from prefill; last step may be trimmed
        rates.append(sum(o.stats.accepted for o in outs) / max(1, sum(o.stats.drafted for o in outs)))
    if draft == "same":
        assert rates == [1.0, 1.0, 1.0]
    elif draft == "unrelated":
        assert max(rates) < 0.5
    elif draft in ("perturbed", "hybrid"):
        assert all(0.0 < r < 1.0 for r in rates)


@pytest.mark.parametrize("draft", ["perturbed", "prompt-lookup"])
def test_batch_equals_one_at_a_time(tiny, draft):
    t = tiny["qwen2"]
    dec = SpeculativeDecoder.from_pretrained(t["target"], t.get(draft, draft), k=3, max_seq_len=128, max_batch=4,
                                             prefill_chunk=16)
    batch = dec.generate(PROMPTS, max_new_tokens=NEW)
    for p, b in zip(PROMPTS, batch):
        assert dec.generate([p], max_new_tokens=NEW)[0].token_ids == b.token_ids


def test_rows_finish_on_their_own(tiny):
    """Each row stops at its own stop id or max_new_tokens; the others keep going, unchanged."""
    t = tiny["llama"]
    dec = SpeculativeDecoder.from_pretrained(t["target"], t["perturbed"], k=3, max_seq_len=128, max_batch=4)
    full = dec.generate(PROMPTS, max_new_tokens=NEW)
    stop = full[0].token_ids[6]
    outs = dec.generate(PROMPTS, max_new_tokens=NEW, stop_token_ids=[stop])
    for f, o in zip(full, outs):
        cut = f.token_ids.index(stop) + 1 if stop in f.token_ids else NEW
        assert o.token_ids == f.token_ids[:cut]
        assert o.finish_reason == ("stop" if stop in f.token_ids else "length")


def test_stream_yields_the_same_tokens(tiny):
    t = tiny["qwen3"]
    dec = SpeculativeDecoder.from_pretrained(t["target"], t["perturbed"], k=4, max_seq_len=128, max_batch=4)
    ref = dec.generate(PROMPTS, max_new_tokens=NEW)
    got = {i: [] for i in range(len(PROMPTS))}
    finished = set()
    for ev in dec.stream(PROMPTS, max_new_tokens=NEW):
        assert ev.index not in finished and 1 <= len(ev.token_ids) <= 5
        got[ev.index] += ev.token_ids
        if ev.finished:
            finished.add(ev.index)
            assert ev.stats is not None and ev.stats.new_tokens == NEW
    assert [got[i] for i in range(len(PROMPTS))] == [o.token_ids for o in ref]
    single = [ev.token_ids for ev in dec.stream(PROMPTS[0], max_new_tokens=NEW)]
    assert sum(single, []) == ref[0].token_ids and len(single) > 1
