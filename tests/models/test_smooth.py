"""Activation smoothing of a quantized copy (models/smooth.py): the float function is unchanged, the embedding
stays the target's, and an outlier input channel stops setting the int8 rounding of its neighbours."""

import copy

import pytest
import torch

from helpers import FAMILIES, make_tiny
from specexport import SpecExportError
from specexport.config import SMOOTH_ALPHA, QuantSpec
from specexport.models import KVCache, load_model
from specexport.models.calibration import calibration_texts
from specexport.models.layer_spec import LayerSpec
from specexport.models.smooth import input_ranges, smooth, smoothed_copy


def _logits(model, ids):
    cache = KVCache.allocate(model.cfg, 1, ids.shape[1], torch.float32)
    with torch.inference_mode():
        return model(ids, torch.zeros(1, dtype=torch.long), cache, ids.shape[1])


@pytest.mark.parametrize("family", FAMILIES + ("llama-tied",))
def test_smoothing_keeps_the_float_function_and_the_embedding(tiny, family, tmp_path):
    if family == "llama-tied":
        make_tiny(tmp_path / "m", "llama", tie_word_embeddings=True)
        path = tmp_path / "m"
    else:
        path = tiny[family]["target"]
    target = load_model(path, max_positions=256)
    model = smoothed_copy(target, SMOOTH_ALPHA)
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_logits(model, ids), _logits(target.model, ids), rtol=1e-4, atol=1e-4)
    assert torch.equal(model.model.embed_tokens.weight, target.model.model.embed_tokens.weight)
    assert not torch.equal(model.model.layers[0].input_layernorm.weight,
                           target.model.model.layers[0].input_layernorm.weight)  # the ranges went somewhere
    if family == "llama-tied":  # the copy's head is its own; the target's stays tied and unscaled
        assert model.lm_head.weight is not model.model.embed_tokens.weight
        assert target.model.lm_head.weight is target.model.model.embed_tokens.weight


def _int8_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """MatMulNBits' int8 activations (accuracy_level 4): each block of the input rounded at max|x| / 127."""
    xb = x.reshape(*x.shape[:-1], -1, block)
    scale = xb.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127
    return (torch.round(xb / scale) * scale).reshape(x.shape)


def test_an_outlier_channel_no_longer_sets_its_blocks_rounding(tiny):
    """Hand-forced: one hidden channel 60x the others at q/k/v's input. Unsmoothed, int8 rounding of that block
    wipes out its neighbours; smoothed, the linear's output under the same rounding is far closer to exact."""
    target = load_model(tiny["llama"]["target"], max_positions=256)
    with torch.no_grad():
        target.model.model.layers[0].input_layernorm.weight[5] *= 60.0
    texts = calibration_texts(target)
    model = smooth(copy.deepcopy(target.model), input_ranges(target.model, texts), SMOOTH_ALPHA)
    ranges = {"plain": input_ranges(target.model, texts)["0.qkv"], "smoothed": input_ranges(model, texts)["0.qkv"]}
    assert ranges["smoothed"].max() / ranges["smoothed"].median() < ranges["plain"].max() / ranges["plain"].median() / 4

    errs = {}
    for name, m in (("plain", target.model), ("smoothed", model)):
        layer, seen = m.model.layers[0], {}
        hook = layer.input_layernorm.register_forward_hook(lambda _m, _a, x: seen.setdefault("x", x))
        _logits(m, torch.tensor([texts[0][0]]))
        hook.remove()
        w, x = layer.self_attn.qkv_proj.weight, seen["x"]
        exact = x @ w.t()
        errs[name] = ((_int8_blocks(x, 32) @ w.t() - exact).norm() / exact.norm()).item()
    assert errs["smoothed"] < errs["plain"] / 2, errs


@pytest.mark.parametrize("text, want", [("quant:int8:smooth", SMOOTH_ALPHA), ("quant:int8:b128:smooth0.5", 0.5),
                                        ("quant:int8:smooth0", 0.0), ("quant:int8", SMOOTH_ALPHA)])
def test_smooth_spec_strings(text, want):
    spec = QuantSpec.parse(text)
    assert spec.smooth == want
    assert QuantSpec.parse(spec.name) == spec
    assert f":smooth{want:g}:head" in spec.name


@pytest.mark.parametrize("text, option, says", [("quant:int8:smooth2", "draft", r"in \[0, 1\]"),
                                                ("quant:int8:smoothly", "draft", "not :smooth"),
                                                ("quant:int8:smooth", "--target-quant", "unknown field")])
def test_bad_smooth_specs(text, option, says):
    with pytest.raises(SpecExportError, match=says):
        QuantSpec.parse(text, option=option)


def test_layer_drafts_refuse_smoothing():
    with pytest.raises(SpecExportError, match=":smooth is for quant: copies"):
        LayerSpec.parse("layers:auto:int8:smooth")
    assert LayerSpec.parse("layers:0-2:int8").quant == "quant:int8"
