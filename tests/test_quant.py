"""Weight-only block quantization (models/quant.py): the codes, their layout in ONNX Runtime's real
MatMulNBits kernel, and the spec strings."""

import numpy as np
import pytest
import torch
from torch import nn

from specexport.errors import SpecExportError
from specexport.config import HEAD_BITS, SMOOTH_ALPHA, QuantSpec
from specexport.models.quant import QuantLinear, dequantize_weight, quantize_model, quantize_weight

SPECS = [QuantSpec(4, 32, False), QuantSpec(4, 16, True), QuantSpec(8, 32, True), QuantSpec(8, 64, False)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_dequantized_error_is_within_half_a_step(spec):
    torch.manual_seed(0)
    w = torch.randn(24, 80)  # K = 80: not a whole number of blocks (padding)
    q = quantize_weight(w, spec)
    nb = -(-80 // spec.block_size)
    assert q["qweight"].shape == (24, nb, spec.block_size * spec.bits // 8) and q["qweight"].dtype == torch.uint8
    assert q["scales"].shape == (24 * nb,)
    assert ("zero_points" in q) == (not spec.symmetric)
    d = dequantize_weight(q, spec, 80)
    step = q["scales"].reshape(24, nb).repeat_interleave(spec.block_size, 1)[:, :80]
    assert ((d - w).abs() <= step * 0.5 + 1e-6).all()


def test_grid_weights_round_trip_exactly():
    """Weights already on a symmetric int8 block grid (as GGUF Q8_0 stores them) come back bit-exact."""
    torch.manual_seed(1)
    scale = torch.rand(8, 2, 1) * 0.01 + 1e-3
    codes = torch.randint(-127, 128, (8, 2, 32)).float()
    codes[:, :, 0] = 127  # every block reaches its full range, as a quantizer's own output does
    w = (codes * scale).reshape(8, 64)
    spec = QuantSpec(8, 32, True)
    assert torch.equal(dequantize_weight(quantize_weight(w, spec), spec, 64), w)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_layout_matches_onnxruntime_matmulnbits(spec, tmp_path):
    """Export one QuantLinear and run it in ONNX Runtime: with accuracy_level 0 (float compute) the kernel must
    reproduce the eager dequantized matmul, which checks nibble order, zero-point packing and padding."""
    import onnxruntime as ort
    torch.manual_seed(2)
    lin = nn.Linear(80, 40, bias=False)
    exact = QuantSpec(spec.bits, spec.block_size, spec.symmetric, accuracy_level=0)
    for s, tol in ((exact, 1e-5), (spec, 3e-2)):  # level 4: int8 activations, close but not exact
        ql = QuantLinear(lin, s).eval()
        x = torch.randn(3, 80)
        path = str(tmp_path / f"q{s.accuracy_level}.onnx")
        torch.onnx.export(ql, (x,), path, dynamo=False, opset_version=18, input_names=["x"],
                          custom_opsets={"com.microsoft": 1})
        sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        got = sess.run(None, {"x": x.numpy()})[0]
        want = ql(x).detach().numpy()
        assert np.abs(got - want).max() <= tol * np.abs(want).max()


def test_quantize_model_replaces_every_linear():
    from helpers import hf_config
    from specexport.models import StaticKVDecoder
    from specexport.models import ModelConfig
    cfg = ModelConfig.from_hf(hf_config("llama", tie_word_embeddings=True).to_dict())
    model = StaticKVDecoder(cfg, 64).fuse()
    emb = model.model.embed_tokens.weight.clone()
    quantize_model(model, QuantSpec(4, 32, False))
    assert not [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert isinstance(model.lm_head, QuantLinear)  # a tied head gets its own codes; the embedding stays float
    assert torch.equal(model.model.embed_tokens.weight, emb)


@pytest.mark.parametrize("text, want", [("quant:int4", QuantSpec(4, 32, False, smooth=SMOOTH_ALPHA, head=HEAD_BITS)),
                                        ("quant:int8", QuantSpec(8, 32, False, smooth=SMOOTH_ALPHA, head=HEAD_BITS)),
                                        ("quant:int8:b64:sym:smooth0:head0", QuantSpec(8, 64, True)),
                                        ("quant:int4:asym:b128", QuantSpec(4, 128, False, smooth=SMOOTH_ALPHA,
                                                                           head=HEAD_BITS))])
def test_spec_strings(text, want):
    assert QuantSpec.parse(text) == want
    assert QuantSpec.parse(want.name) == want


@pytest.mark.parametrize("text, says", [("quant:int3", "int4 or quant:int8"), ("quant:int4:b24", "power of two"),
                                        ("quant:int4:b8", "power of two"), ("quant:int4:fast", "unknown field"),
                                        ("quant:", "int4 or quant:int8")])
def test_bad_spec_strings(text, says):
    with pytest.raises(SpecExportError, match=says):
        QuantSpec.parse(text)
