"""GGUF quantized tensors as stored (models/gguf_quant.py): codes, scales and minimums that dequantize bit for bit
as gguf.quants.dequantize, joined projections, and ONNX Runtime's MatMulNBits (+ the minimum term) over them."""

import numpy as np
import pytest
import torch

from specexport.models.gguf_quant import QUANTIZED_FORMATS, block_codes, join_rows
from specexport.models.quant import QuantLinear

N, K = 6, 512  # K: two K-quant super-blocks of 256


def random_tensor(fmt: str, seed: int = 0) -> np.ndarray:
    """Random raw blocks of `fmt` for an [N, K] tensor: random code bytes, finite random fp16 scale fields."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    per_block, size = GGML_QUANT_SIZES[GGMLQuantizationType[fmt]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (N * K // per_block, size), dtype=np.uint8)
    f16 = lambda n: rng.normal(0, 0.05, (raw.shape[0], n)).astype(np.float16).view(np.uint8)  # noqa: E731
    if fmt in ("Q4_0", "Q5_0", "Q8_0"):
        raw[:, :2] = f16(1)
    elif fmt in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):
        raw[:, :4] = f16(2)  # d and m (or dmin)
    elif fmt == "Q6_K":
        raw[:, -2:] = f16(1)
    return raw.reshape(N, -1)


@pytest.mark.parametrize("fmt", QUANTIZED_FORMATS)
def test_dequantize_is_bit_for_bit_gguf(fmt):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    raw = random_tensor(fmt)
    want = dequantize(raw, GGMLQuantizationType[fmt]).reshape(N, K).astype(np.float32)
    bc = block_codes(fmt, raw, (N, K))
    assert bc.codes.max() < 2 ** bc.bits and bc.shape == (N, K)
    got = bc.dequantize()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    layer = QuantLinear.from_codes(bc)  # the engine's layer: its packed codes dequantize to the same bits
    assert np.array_equal(layer.dequantized().numpy().view(np.uint32), want.view(np.uint32))


def test_joined_formats_lose_nothing():
    """A fused projection over a Q4_K part and a Q6_K part (Q4_K_M files mix them): finest block, widest code."""
    parts = [block_codes(f, random_tensor(f, i), (N, K)) for i, f in enumerate(("Q4_K", "Q6_K", "Q8_0"))]
    joined = join_rows(parts)
    assert (joined.bits, joined.block, joined.fmt) == (8, 16, "mixed")
    want = np.concatenate([p.dequantize() for p in parts])
    # equal values (a part without a minimum gets + 0.0 there, which turns a -0.0 weight into +0.0)
    assert np.array_equal(joined.dequantize(), want)
    assert np.array_equal(QuantLinear.from_codes(joined).dequantized().numpy(), want)


@pytest.mark.parametrize("fmt", ["Q4_1", "Q4_K", "Q5_1", "Q6_K", "Q8_0"])
def test_matmulnbits_with_minimums_matches_eager(fmt, tmp_path):
    """Exported, a layer is MatMulNBits (+ min @ blocksum(x) for formats with a minimum): with fp32 activations
    ONNX Runtime reproduces the eager matmul over the dequantized weights; with int8 activations it is close. Over
    [B, T, K] (the step graphs' form) the block sums are one AveragePool; over other ranks a ReduceMean."""
    import onnx
    import onnxruntime as ort
    bc = block_codes(fmt, random_tensor(fmt, 4), (N, K))
    for shape in ((3, K), (2, 3, K)):
        x = torch.randn(*shape)
        for level, tol in ((0, 1e-5), (4, 3e-2)):
            layer = QuantLinear.from_codes(bc, accuracy_level=level).eval()
            assert layer.spec.pooled == (bc.mins is not None)
            path = str(tmp_path / f"{fmt}{level}.onnx")
            torch.onnx.export(layer, (x,), path, dynamo=False, opset_version=18, input_names=["x"],
                              custom_opsets={"com.microsoft": 1})
            ops = {n.op_type for n in onnx.load(path).graph.node}
            if bc.mins is not None:
                assert ops >= ({"AveragePool"} if len(shape) == 3 else {"ReduceMean"}) and "ReduceSum" not in ops
            got = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]
            want = (x @ torch.from_numpy(bc.dequantize()).t()).numpy()
            assert np.abs(got - want).max() <= tol * np.abs(want).max()


def test_engines_built_before_pooled_minimums_still_load(tmp_path):
    """An engine built before `pooled` stores each minimum as it is and sums blocks with Reshape + ReduceSum: its
    manifest's spec (no `pooled`) still dequantizes bit for bit and still exports and runs the same."""
    import dataclasses
    import onnx
    import onnxruntime as ort
    bc = block_codes("Q4_1", random_tensor("Q4_1", 5), (N, K))
    new = QuantLinear.from_codes(bc, accuracy_level=0).eval()
    rec = {k: v for k, v in dataclasses.asdict(new.spec).items() if k != "pooled"}  # an older manifest's record
    old = QuantLinear(None, type(new.spec)(**rec), (N, K)).eval()
    state = {**new.state_dict(), "mins": new.state_dict()["mins"] / bc.block}
    old.load_state_dict(state)
    assert not old.spec.pooled
    from specexport.errors import SpecExportError
    with pytest.raises(SpecExportError, match="pooled=True.*needs mins=True"):
        type(new.spec)(bits=4, pooled=True)
    assert np.array_equal(old.dequantized().numpy().view(np.uint32), new.dequantized().numpy().view(np.uint32))
    x = torch.randn(1, 3, K)
    path = str(tmp_path / "old.onnx")
    torch.onnx.export(old, (x,), path, dynamo=False, opset_version=18, input_names=["x"],
                      custom_opsets={"com.microsoft": 1})
    assert "ReduceSum" in {n.op_type for n in onnx.load(path).graph.node}
    got = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]
    want = (x @ torch.from_numpy(bc.dequantize()).t()).numpy()
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_unsupported_format_is_a_clear_error():
    from specexport.errors import SpecExportError
    with pytest.raises(SpecExportError, match="IQ2_XXS has no MatMulNBits form.*--dtype fp32"):
        block_codes("IQ2_XXS", np.zeros((1, 66), np.uint8), (1, 256))
