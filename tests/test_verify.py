"""The acceptance rule with hand-forced logits (vLLM's rejection-sampler tests are the model)."""

import pytest
import torch

from specexport.verify import process_logits, sample_from, verify_greedy, verify_sampling

V = 6
NEG = -1e9


def forced(tokens_per_pos, B=1):
    """Logits [B, len, V] whose argmax at position i is tokens_per_pos[i]."""
    x = torch.full((B, len(tokens_per_pos), V), NEG)
    for i, t in enumerate(tokens_per_pos):
        x[:, i, t] = 0.0
    return x


def one_hot(tokens, B=1):
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float().expand(B, -1, -1).clone()


def test_greedy_perfect_match_gives_bonus():
    n, nxt, out = verify_greedy(forced([1, 2, 3, 4]), torch.tensor([[1, 2, 3]]), torch.tensor([3]))
    assert n.tolist() == [3] and nxt.tolist() == [4] and out.tolist() == [[1, 2, 3, 4]]


def test_greedy_early_mismatch_recovers_target_token():
    n, nxt, out = verify_greedy(forced([1, 5, 3, 4]), torch.tensor([[1, 2, 3]]), torch.tensor([3]))
    assert n.tolist() == [1] and nxt.tolist() == [5] and out.tolist() == [[1, 5, -1, -1]]


def test_greedy_first_mismatch_and_ragged_rows():
    p = torch.cat([forced([0, 1, 2, 3]), forced([4, 4, 4, 4]), forced([1, 2, 3, 5])])
    d = torch.tensor([[5, 1, 2], [4, 4, 4], [1, 2, 3]])
    n, nxt, out = verify_greedy(p, d, torch.tensor([3, 3, 1]))  # row 2 has only one real draft token
    assert n.tolist() == [0, 3, 1] and nxt.tolist() == [0, 4, 2]
    assert out.tolist() == [[0, -1, -1, -1], [4, 4, 4, 4], [1, 2, -1, -1]]


def test_sampling_perfect_match_accepts_everything_and_bonus_from_p():
    p = one_hot([1, 2, 3, 4])
    q = one_hot([1, 2, 3])
    u = torch.full((1, 3), 0.999)
    n, nxt, out = verify_sampling(p, q, torch.tensor([[1, 2, 3]]), torch.tensor([3]), u, torch.tensor([0.5]))
    assert n.tolist() == [3] and nxt.tolist() == [4] and out.tolist() == [[1, 2, 3, 4]]


def test_sampling_rejection_draws_from_residual():
    # p(d0) = 0.25, q(d0) = 1: accepted iff u < 0.25; on rejection the recovered token comes from
    # norm(max(p - q, 0)) which excludes d0.
    p = torch.tensor([[[0.25, 0.75, 0, 0, 0, 0], [0, 0, 1.0, 0, 0, 0]]])
    q = one_hot([0])
    d = torch.tensor([[0]])
    n, nxt, _ = verify_sampling(p, q, d, torch.tensor([1]), torch.tensor([[0.2]]), torch.tensor([0.3]))
    assert n.tolist() == [1] and nxt.tolist() == [2]  # accepted, then bonus from p at position 2
    n, nxt, _ = verify_sampling(p, q, d, torch.tensor([1]), torch.tensor([[0.3]]), torch.tensor([0.0]))
    assert n.tolist() == [0] and nxt.tolist() == [1]  # rejected; residual is all on token 1


def test_one_hot_q_is_the_same_as_explicit_one_hot():
    torch.manual_seed(0)
    B, k = 64, 3
    p = torch.softmax(torch.randn(B, k + 1, V) * 2, -1)
    d = torch.randint(0, V, (B, k))
    u, un = torch.rand(B, k), torch.rand(B)
    dl = torch.full((B,), k)
    a = verify_sampling(p, None, d, dl, u, un)
    b = verify_sampling(p, torch.nn.functional.one_hot(d, V).float(), d, dl, u, un)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_padding_drafts_are_never_accepted_and_next_comes_from_p():
    p = one_hot([3, 3, 3])
    d = torch.tensor([[3, 3]])
    n, nxt, out = verify_sampling(p, None, d, torch.tensor([1]), torch.zeros(1, 2), torch.tensor([0.5]))
    assert n.tolist() == [1] and nxt.tolist() == [3] and out.tolist() == [[3, 3, -1]]


def test_sample_from_is_inverse_cdf_and_skips_zero_mass():
    probs = torch.tensor([0.5, 0.0, 0.5, 0.0])
    assert [sample_from(probs, torch.tensor(u)).item() for u in (0.0, 0.49, 0.5, 0.99)] == [0, 0, 2, 2]


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.0, 3, 1.0), (1.3, 0, 0.6), (0.9, 4, 0.8)])
def test_process_logits_matches_transformers_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    torch.manual_seed(1)
    logits = torch.randn(3, 2, 50) * 3
    procs = LogitsProcessorList([TemperatureLogitsWarper(temperature)]
                                + ([TopKLogitsWarper(top_k)] if top_k else [])
                                + ([TopPLogitsWarper(top_p)] if top_p < 1 else []))
    ref = torch.stack([procs(None, logits[:, t]).softmax(-1) for t in range(2)], 1)
    ours = process_logits(logits, torch.full((3,), temperature), torch.full((3,), top_k), torch.full((3,), top_p))
    torch.testing.assert_close(ours, ref)


def test_top_p_one_keeps_the_whole_tail_when_the_filter_runs():
    """Exported graphs always run the filter; rows with top_p=1 must still keep every token (the float cumsum
    reaches 1.0 before the tail of a 49152-token vocabulary)."""
    logits = torch.randn(2, 3, 49152) * 3
    t, k, p = torch.tensor([1.0, 0.7]), torch.tensor([0, 0]), torch.tensor([1.0, 1.0])
    torch.testing.assert_close(process_logits(logits, t, k, p, filter=True), process_logits(logits, t, k, p, filter=False))
    assert bool((process_logits(logits, t, k, p, filter=True) > 0).all())


def _sized_filter_graph(V: int, filter="sized") -> bytes:
    """process_logits(filter=...) as exported (x [B, T, V], top_k [B], top_p [B] -> probs)."""
    import io

    class Probs(torch.nn.Module):
        def forward(self, x, top_k, top_p):
            return process_logits(x, torch.ones(top_k.shape), top_k, top_p, filter=filter)
    f = io.BytesIO()
    torch.onnx.export(Probs(), (torch.randn(2, 3, V), torch.tensor([0, 0]), torch.tensor([1.0, 1.0])), f,
                      dynamo=False, opset_version=18, input_names=["x", "top_k", "top_p"], output_names=["p"],
                      dynamic_axes={"x": {0: "B", 1: "T"}, "top_k": {0: "B"}, "top_p": {0: "B"}})
    return f.getvalue()


@pytest.mark.parametrize("nucleus", [8, 1024])  # the first sort's size for top-p: all 50 here, or 8 (then some
@pytest.mark.parametrize("top_k,top_p", [([0, 0], [1.0, 1.0]), ([3, 0], [1.0, 1.0]), ([0, 50], [1.0, 1.0]),
                                         ([0, 0], [0.6, 1.0]), ([4, 0], [1.0, 0.8]), ([2, 7], [0.9, 0.3]),
                                         ([60, 0], [1.0, 1.0]), ([0, 0], [0.99, 0.2]), ([12, 0], [0.97, 1.0])])
def test_the_sized_filter_keeps_what_the_full_sort_keeps(monkeypatch, top_k, top_p, nucleus):  # rows sort all)
    """ONNX Runtime's graphs sort only as many logits as the batch's top-k / top-p need (K = 1 with neither):
    per row, the same tokens survive as with the full sort, ties at a threshold included, and the same
    probabilities."""
    import onnx
    import onnxruntime as ort

    from specexport import verify
    monkeypatch.setattr(verify, "NUCLEUS", nucleus)
    V = 50
    proto = _sized_filter_graph(V)
    nodes = onnx.load_from_string(proto).graph.node
    topk = [n for n in nodes if n.op_type == "TopK"]
    assert len(topk) == 2 and all([m.op_type for m in nodes if t.input[1] in m.output] in (["Max"], ["Where"])
                                  for t in topk)  # K: computed from the batch's settings, not V
    sess = ort.InferenceSession(proto, providers=["CPUExecutionProvider"])
    torch.manual_seed(3)
    x = (torch.randn(2, 3, V) * 3).round(decimals=1)  # rounded: ties, some at the thresholds
    tk, tp = torch.tensor(top_k), torch.tensor(top_p)
    ref = process_logits(x, torch.ones(2), tk, tp, filter=True)
    got = torch.from_numpy(sess.run(None, {"x": x.numpy(), "top_k": tk.numpy(), "top_p": tp.numpy()})[0])
    assert torch.equal(got > 0, ref > 0)
    torch.testing.assert_close(got, ref)


def test_the_sized_filter_ends_a_nucleus_where_the_full_sort_does(monkeypatch):
    """top_p within a few ulps of the first token's mass (an independent review's case: before the mass before a
    token was the running sum itself, 492 of 2,000 such draws kept a token fewer than the full sort): the first
    sort at 1 logit against ONNX Runtime's full-sort graph, the same tokens kept."""
    import numpy as np
    import onnxruntime as ort

    from specexport import verify
    full = ort.InferenceSession(_sized_filter_graph(3, filter=True), providers=["CPUExecutionProvider"])
    monkeypatch.setattr(verify, "NUCLEUS", 1)
    sized = ort.InferenceSession(_sized_filter_graph(3), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    for _ in range(300):
        p = np.array([0.4, 0.35, 0.25]) + rng.uniform(-0.02, 0.02, 3)
        x = np.log(p / p.sum()).astype(np.float32)[None, None]  # [1, 1, 3]
        tp = np.float32(np.exp(x[0, 0, 0] - np.log(np.exp(x[0, 0].astype(np.float64)).sum())))
        for _ in range(3):
            tp = np.nextafter(tp, np.float32(0))
        for _ in range(7):  # 3 ulps below the first token's mass to 3 above
            feed = {"x": x, "top_k": np.array([0]), "top_p": np.array([tp], np.float32)}
            assert np.array_equal(sized.run(None, feed)[0] > 0, full.run(None, feed)[0] > 0)
            tp = np.nextafter(tp, np.float32(1))


def test_per_position_acceptance_from_the_histograms():
    from specexport.request import GenerationStats
    # 4 steps at k=3: accepted 0, 1, 3, 2 of proposals 3, 3, 3, 2 (a ragged prompt-lookup draft)
    st = GenerationStats(accept_hist=[1, 1, 1, 1], proposed_hist=[0, 0, 1, 3])
    assert st.accepted_per_pos == [3, 2, 1] and st.drafted_per_pos == [4, 4, 3]
    assert st.acceptance_per_pos == [0.75, 0.5, 1 / 3]
    assert st.as_dict()["accepted_per_pos"] == [3, 2, 1]
