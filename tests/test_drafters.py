"""The hybrid drafter with hand-made proposals: which rows take lookup's proposal, one-hot q for them when
sampling, and no draft pass on a step where every row matched."""

import numpy as np

from specexport.drafters import DraftInputs, HybridDrafter, ModelDrafter, PromptLookupDrafter, Proposal


class CountingEngine:
    """An engine stand-in that records draft calls and drafts 7s with a uniform q (V = 10)."""

    def __init__(self):
        self.calls = 0

    def draft(self, last_two, past_len, kv_len, k, sampling, u):
        self.calls += 1
        B = last_two.shape[0]
        q = np.full((B, k, 10), 0.1, dtype=np.float32) if sampling is not None else None
        return np.full((B, k), 7, dtype=np.int64), q


def inputs(rows: list[list[int]], k: int, sampling=None) -> DraftInputs:
    B, L = len(rows), max(map(len, rows))
    hist = np.zeros((B, 32), dtype=np.int64)
    for b, r in enumerate(rows):
        hist[b, :len(r)] = r
    last = np.array([[r[-2], r[-1]] for r in rows])
    return DraftInputs(last, np.array([len(r) - 1 for r in rows]), L + k, hist, [len(r) for r in rows], sampling,
                       np.zeros((B, k), dtype=np.float32))


def test_rows_take_lookup_where_it_matched_at_least_min_match_tokens():
    eng = CountingEngine()
    h = HybridDrafter(PromptLookupDrafter(1, 3), ModelDrafter(eng, "m"), min_match=2)
    # row 0: "4 5" recurs (2-gram match) -> lookup proposes 6 9; row 1: only "5" recurs (1-gram) -> the model
    p = h.propose(inputs([[4, 5, 6, 9, 4, 5], [1, 5, 2, 3, 8, 5]], k=2), 2)
    assert eng.calls == 1 and p.model_ran
    assert p.draft.tolist() == [[6, 9], [7, 7]] and p.draft_len.tolist() == [2, 2] and p.source == [2, 0]
    # every row matched: no draft pass
    p = h.propose(inputs([[4, 5, 6, 9, 4, 5], [3, 3, 1, 3, 3]], k=2), 2)
    assert eng.calls == 1 and not p.model_ran and p.q is None and p.source == [2, 2]


def test_lookup_rows_get_one_hot_q_when_sampling():
    eng = CountingEngine()
    h = HybridDrafter(PromptLookupDrafter(1, 3), ModelDrafter(eng, "m"), min_match=2)
    x = inputs([[4, 5, 6, 9, 4, 5], [1, 5, 2, 3, 8, 5]], k=2, sampling=object())
    lk, use = h.lookups(x, 2)
    assert use == [True, False]
    p = h.merge(lk, use, Proposal(*eng.draft(x.last_two, None, 0, 2, x.sampling, None),
                                  np.full(2, 2, dtype=np.int64), 2, model_ran=True), x.sampling)
    assert p.q[0, 0].tolist() == [0] * 6 + [1] + [0] * 3 and p.q[0, 1, 9] == 1.0 and p.q[0].sum() == 2.0
    assert np.allclose(p.q[1], 0.1)  # the model's row keeps its q


def test_lookup_copies_from_the_occurrence_whose_context_matches_furthest_back():
    # the suffix "2 3 4" occurs twice before; "1 2 3 4" only once: that is the passage being copied (-> 5 6),
    # while the latest 3-gram occurrence (-> 8 8) is a chance repeat
    seq = np.array([1, 2, 3, 4, 5, 6, 9, 2, 3, 4, 8, 8, 0, 1, 2, 3, 4])
    draft, n = PromptLookupDrafter(1, 3).lookup(seq, 2)
    assert draft.tolist() == [5, 6] and n == 3  # n, the proposal's source for specexport/autok, stays at most ngram_max
    draft, n = PromptLookupDrafter(1, 3, context_max=3).lookup(seq, 2)  # context no longer than the n-gram
    assert draft.tolist() == [8, 8] and n == 3
    # equal context: the latest occurrence with k tokens after it, else the earliest
    assert PromptLookupDrafter(1, 3).lookup(np.array([7, 1, 2, 7, 1, 3, 7, 1]), 2)[0].tolist() == [3, 7]
    assert PromptLookupDrafter(1, 3).lookup(np.array([7, 1, 2, 7, 1, 3, 7, 1]), 5)[0].tolist() == [2, 7, 1, 3, 7]
    assert PromptLookupDrafter(2, 3).lookup(np.array([5, 1, 6, 1]), 2)[0].tolist() == []  # below ngram_min


class ChainEngine:
    """A fused draft over the target's cache (one pass per call; until may end the chain): drafts 4, 5, 6, ... with
    a uniform q (V = 10); margins [B, k]: the margin of each row's i-th draft (None: the engine reports none)."""
    fused = kv_shared = True

    def __init__(self, margins=None):
        self.calls, self.margins = 0, margins

    def draft(self, last_two, past_len, kv_len, k, sampling, u, until=None):
        B, drafts = last_two.shape[0], []
        for i in range(k):
            m = None if self.margins is None else np.asarray(self.margins, np.float32)[:B, :i]
            if i and until is not None and until(np.stack(drafts, 1), m):
                break
            self.calls += 1
            drafts.append(np.full(B, 4 + i, dtype=np.int64))
        d = np.stack(drafts, 1)
        return d, (np.full((*d.shape, 10), 0.1, dtype=np.float32) if sampling is not None else None)


def test_the_model_hands_over_to_lookup_once_its_drafts_complete_a_match():
    # row 0 ends in 1 (no match): the model drafts 4 ("1 4": still no 2-gram match), then 5: "4 5" matches the
    # start, so lookup proposes the rest (6 9) and the row needs no third pass; row 1 never matches
    rows = [[4, 5, 6, 9, 1], [3, 3, 8]]
    for B, calls in ((1, 2), (2, 4)):  # the chain ends once every model row has handed over
        eng = ChainEngine()
        h = HybridDrafter(PromptLookupDrafter(1, 3), ModelDrafter(eng, "m"), min_match=2)
        p = h.propose(inputs(rows[:B], k=4, sampling=object()), 4)
        assert eng.calls == calls and p.passes == calls and p.model_ran
        assert p.draft[0].tolist() == [4, 5, 6, 9] and p.draft_len[0] == 4 and p.handover[0] == (2, 2)
        assert np.allclose(p.q[0, :2], 0.1)  # the model's q for its own tokens, one-hot for lookup's
        assert p.q[0, 2].tolist() == [0] * 6 + [1] + [0] * 3 and p.q[0, 3, 9] == 1.0 and p.q[0, 3].sum() == 1.0
        if B == 2:
            assert p.draft[1].tolist() == [4, 5, 6, 7] and p.handover[1] is None and np.allclose(p.q[1], 0.1)
    eng = ChainEngine()  # off: the model drafts all k
    h = HybridDrafter(PromptLookupDrafter(1, 3), ModelDrafter(eng, "m"), min_match=2, handover=False)
    p = h.propose(inputs(rows[:1], k=4), 4)
    assert eng.calls == 4 and p.draft[0].tolist() == [4, 5, 6, 7] and p.handover is None


def test_the_model_hands_over_only_where_the_rule_says_it_pays():
    """HybridDrafter.model_propose(pays=): a match that the rule (autok.AutoK.handover_pays) refuses leaves the row
    to the model, which drafts on; the rule is asked with (row, model drafts so far, lookup's source, its tokens)."""
    rows = [[4, 5, 6, 9, 1]]  # the model's "4 5" completes a 2-gram match after two passes (test above)
    asked = []
    for answer, calls, draft, handover in ((False, 4, [4, 5, 6, 7], None), (True, 2, [4, 5, 6, 9], (2, 2))):
        eng = ChainEngine()
        h = HybridDrafter(PromptLookupDrafter(1, 3), ModelDrafter(eng, "m"), min_match=2)
        p = h.model_propose(inputs(rows, k=4), 4, [False], lambda b, j, s, n: asked.append((b, j, s, n)) or answer)
        assert eng.calls == calls and p.draft[0].tolist() == draft and (p.handover or [None])[0] == handover
    assert asked[0] == (0, 2, 2, 2) and asked[-1] == (0, 2, 2, 2)


def test_a_row_ends_its_drafts_after_a_near_tie():
    """The margin stop (ModelDrafter.min_margin): a draft whose top logit leads the runner-up by less than
    min_margin is its row's last; the other rows go on, and the chain ends when every row has ended."""
    margins = [[2.0, 0.05, 3.0, 3.0], [2.0, 2.0, 2.0, 0.1], [0.1, 3.0, 3.0, 3.0]]
    eng = ChainEngine(margins)
    p = ModelDrafter(eng, "m", min_margin=0.15).propose(inputs([[1, 2], [1, 3], [2, 3]], k=4, sampling=object()), 4)
    assert eng.calls == 4 and p.passes == 4  # row 1 never ties before its last draft
    assert p.draft_len.tolist() == [2, 4, 1] and p.longest == 4
    assert p.tied.tolist() == [True, False, True]  # whose last draft is the tie (autok.AutoK.observe_chain)
    assert p.draft.tolist() == [[4, 5, 0, 0], [4, 5, 6, 7], [4, 0, 0, 0]]  # padding after a row's end
    assert np.allclose(p.q[0, :2], 0.1) and not p.q[0, 2:].any() and not p.q[2, 1:].any()
    assert np.allclose(p.margin, np.asarray(margins, np.float32)[:, :3])
    eng2 = ChainEngine([margins[0], margins[2]])  # rows 0 and 2 alone: the chain ends after row 0's second pass
    p = ModelDrafter(eng2, "m", min_margin=0.15).propose(inputs([[1, 2], [2, 3]], k=4), 4)
    assert eng2.calls == 2 and p.passes == 2 and p.draft_len.tolist() == [2, 1] and p.draft.shape == (2, 4)
    for off in (ModelDrafter(ChainEngine(margins), "m"), ModelDrafter(ChainEngine(None), "m", min_margin=0.15)):
        p = off.propose(inputs([[1, 2], [1, 3], [2, 3]], k=4), 4)  # off, or an engine without margins: all k
        assert p.passes == 4 and p.draft_len.tolist() == [4, 4, 4]


def test_a_row_that_takes_lookups_proposal_is_not_tied():
    """`Proposal.tied` (autok.AutoK.observe_chain) marks the model rows whose chain ended at a near-tie; a row that
    takes lookup's proposal outright is never one, whatever the model's margins there."""
    eng = ChainEngine([[0.05, 3.0, 3.0, 3.0], [3.0, 0.05, 3.0, 3.0]])  # row 0's first draft would tie
    h = HybridDrafter(PromptLookupDrafter(1, 3), ModelDrafter(eng, "m", min_margin=0.15), min_match=2, handover=False)
    p = h.propose(inputs([[4, 5, 6, 9, 4, 5], [4, 5, 6, 9, 1]], k=4), 4)  # row 0: "4 5" recurs (lookup)
    assert p.source == [2, 0] and p.draft_len.tolist() == [4, 2] and p.tied.tolist() == [False, True]


def test_the_margin_stop_comes_before_the_handover():
    """In the hybrid, a row whose draft ties ends there, even where its drafts so far would complete a lookup
    match; rows that take lookup's proposal outright do not hold the chain."""
    rows = [[4, 5, 6, 9, 1], [4, 5, 6, 9, 1]]  # "... 4 5" would match the start after the second draft
    eng = ChainEngine([[3.0, 0.05, 3.0, 3.0], [3.0, 3.0, 3.0, 3.0]])
    h = HybridDrafter(PromptLookupDrafter(1, 3), ModelDrafter(eng, "m", min_margin=0.15), min_match=2)
    p = h.propose(inputs(rows, k=4), 4)
    assert p.draft[0].tolist() == [4, 5, 0, 0] and p.draft_len[0] == 2 and p.handover[0] is None
    assert p.draft[1].tolist() == [4, 5, 6, 9] and p.handover[1] == (2, 2)
    assert eng.calls == 2 and p.tied.tolist() == [True, False]
