"""A quantized copy's rescored head (models/rescore.py): its top candidates carry the target head's exact logits,
the target's head tensor is read, not copied, and a target with no float head keeps the plain head."""

import pytest
import torch
from torch import nn

from helpers import make_tiny
from specexport import SpecExportError
from specexport.config import HEAD_BITS, QuantSpec
from specexport.draft_models import quantized_copy
from specexport.models import KVCache, load_model
from specexport.models.layer_spec import LayerSpec
from specexport.models.quant import QuantLinear
from specexport.models.rescore import SAMPLING_TOP, TOP, RescoredHead, head_scale


def _hidden_and_logits(model, ids):
    """(the final norm's output [T, D], the logits [T, V]) of a teacher-forced pass."""
    seen = {}
    hook = model.model.norm.register_forward_hook(lambda _m, _a, x: seen.setdefault("x", x))
    cache = KVCache.allocate(model.cfg, 1, ids.shape[1], torch.float32)
    with torch.inference_mode():
        logits = model(ids, torch.zeros(1, dtype=torch.long), cache, ids.shape[1])
    hook.remove()
    return seen["x"][0], logits[0]


def test_hand_forced_coarse_head_picks_the_exact_top_among_its_candidates():
    """The coarse head ranks the exact head's top token 5th of V: the rescored logits put it first, carry the
    exact values at every candidate, and leave the other logits coarse."""
    g = torch.Generator().manual_seed(0)
    V, D = 64, 32
    exact = torch.randn(V, D, generator=g)
    scale = torch.rand(D, generator=g) + 0.5
    x = torch.randn(3, D, generator=g)  # the copy's hidden state: the target's divided by scale
    want = (x * scale) @ exact.t()  # [3, V]
    head = RescoredHead(nn.Linear(D, V, bias=False), exact, scale, n=8)
    coarse = torch.randn(3, V, generator=g)
    order = want.argsort(-1, descending=True)
    bumped = coarse.clone()  # forge the coarse ranking: the exact top token sits 5th, four others above it
    bumped.scatter_(1, order[:, 1:5], coarse.max(-1, keepdim=True).values + torch.arange(1, 5.0))
    bumped.scatter_(1, order[:, :1], coarse.max(-1, keepdim=True).values + 0.5)
    head.coarse = _Const(bumped)
    out = head(x)
    assert torch.equal(out.argmax(-1), want.argmax(-1))
    top = bumped.topk(8, -1).indices
    torch.testing.assert_close(out.gather(1, top), want.gather(1, top))
    rest = torch.ones_like(out, dtype=torch.bool).scatter(1, top, False)
    assert torch.equal(out[rest], bumped[rest])


class _Const(nn.Module):
    def __init__(self, y):
        super().__init__()
        self.y = y

    def forward(self, x):
        return self.y


@pytest.mark.parametrize("tied", [False, True])
def test_the_copy_rescores_with_the_targets_own_head(tmp_path, tied):
    make_tiny(tmp_path / "m", "llama", tie_word_embeddings=tied, logit_scale=4.0)
    target = load_model(tmp_path / "m", max_positions=256)
    draft = quantized_copy(target, QuantSpec.parse("quant:int8"))
    head = draft.model.lm_head
    assert isinstance(head, RescoredHead) and isinstance(head.coarse, QuantLinear) and head.coarse.spec.bits == 4
    assert head.exact is target.model.lm_head.weight  # the target's tensor itself: shared, never copied
    assert draft.source.endswith(f":head{HEAD_BITS}") and draft.record["rescored_head"]["top"] == TOP
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(1))
    x, logits = _hidden_and_logits(draft.model, ids)
    exact = (x * head.scale) @ target.model.lm_head.weight.t()  # the target's head over the copy's hidden state
    top = head.coarse(x).topk(TOP, -1).indices
    torch.testing.assert_close(logits.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-5)
    # the scale undoes the smoothing folded into the copy's final norm
    torch.testing.assert_close(head.scale, head_scale(target.model.model.norm.weight, draft.model.model.norm.weight))
    assert not torch.allclose(head.scale, torch.ones_like(head.scale))


def test_a_sampling_step_rescores_more_candidates(tmp_path):
    """A sampling draft's q is its whole distribution, so a sampling step's passes rescore SAMPLING_TOP candidates
    and a greedy step's TOP: the head at each width, and the step modules setting it."""
    from specexport.steps import make_step
    g = torch.Generator().manual_seed(1)
    V, D = 600, 32
    exact, scale = torch.randn(V, D, generator=g), torch.rand(D, generator=g) + 0.5
    head = RescoredHead(nn.Linear(D, V, bias=False), exact, scale)
    x = torch.randn(2, D, generator=g)
    want, coarse = (x * scale) @ exact.t(), head.coarse(x)
    for sampling, n in ((False, TOP), (True, SAMPLING_TOP)):
        head.sampling = sampling
        got = head(x)
        top = coarse.topk(n, -1).indices
        torch.testing.assert_close(got.gather(-1, top), want.gather(-1, top))
        assert int((got != coarse).sum(-1).max()) <= n  # the rest stay coarse
    make_tiny(tmp_path / "m", "llama", logit_scale=4.0)
    draft = quantized_copy(load_model(tmp_path / "m", max_positions=64), QuantSpec.parse("quant:int8")).model
    for sampling in (True, False):
        step = make_step(draft, "draft_pass", 1, sampling, draft.cfg.vocab_size)
        rest = (torch.ones(1), torch.zeros(1, dtype=torch.long), torch.ones(1), torch.zeros(1, dtype=torch.bool),
                torch.full((1, 1), 0.5)) if sampling else ()
        kv = KVCache.allocate(draft.cfg, 1, 64, torch.float32)
        with torch.inference_mode():
            step(torch.tensor([[5]]), torch.zeros(1, dtype=torch.long), torch.arange(8), *rest, *kv.keys, *kv.values)
        assert draft.lm_head.sampling is sampling


def test_head0_and_a_target_without_a_float_head_keep_the_plain_head(tmp_path):
    make_tiny(tmp_path / "m", "llama", logit_scale=4.0)
    target = load_model(tmp_path / "m", max_positions=256)
    plain = quantized_copy(target, QuantSpec.parse("quant:int8:head0"))
    assert isinstance(plain.model.lm_head, QuantLinear) and plain.source.endswith(":head0")
    target.model.lm_head = QuantLinear(target.model.lm_head, QuantSpec(8, 32))  # as a GGUF's Q8_0 head as stored
    copy = quantized_copy(target, QuantSpec.parse("quant:int8"))
    assert isinstance(copy.model.lm_head, QuantLinear) and copy.source.endswith(":head0")  # the name says so


@pytest.mark.parametrize("text, want", [("quant:int8", HEAD_BITS), ("quant:int8:head8", 8), ("quant:int4:head0", 0)])
def test_head_spec_strings(text, want):
    spec = QuantSpec.parse(text)
    assert spec.head == want and QuantSpec.parse(spec.name) == spec and spec.name.endswith(f":head{want}")


@pytest.mark.parametrize("text, option, says", [("quant:int8:head3", "draft", "not :head4"),
                                                ("quant:int8:head4", "--target-quant", "unknown field")])
def test_bad_head_specs(text, option, says):
    with pytest.raises(SpecExportError, match=says):
        QuantSpec.parse(text, option=option)
    with pytest.raises(SpecExportError, match=":head is for quant: copies"):
        LayerSpec.parse("layers:auto:int8:head4")
