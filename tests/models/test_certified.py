"""The certified head (models/certified.py, export/certified_graph.py): its bound holds on ONNX Runtime's own
kernel, a proven row and a fallback row give the full head's argmax, a tie goes to the lowest id as ArgMax does,
and a row's token does not depend on the other rows of its pass."""

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

from specexport.config import QuantSpec
from specexport.export.certified_graph import DOMAIN, coarse_model, expand_certified
from specexport.models.certified import BLOCK, CertifiedHead, certified_head
from specexport.models.quant import QuantLinear

V, D = 3000, 128


def _weight(seed: int = 0, q8: bool = False) -> torch.Tensor:
    """[V, D]: random, or exactly representable by 8-bit symmetric blocks of 32 (as a GGUF's Q8_0 head)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, D, generator=g) * 0.05
    if q8:
        blocks = w.reshape(V, D // BLOCK, BLOCK)
        d = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
        w = ((blocks / d).round().clamp(-127, 127) * d).reshape(V, D)
    return w


class _Argmax(nn.Module):
    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(w, requires_grad=False)
        self.head = CertifiedHead(w)

    def forward(self, x):  # [B, T, D] -> [B, T]
        return self.head(x, self.weight)


def _session(module: nn.Module, tmp_path) -> ort.InferenceSession:
    """The module exported as the step graphs are (the marker node, then expand_certified), on ONNX Runtime."""
    import onnx
    f = str(tmp_path / "head.onnx")
    torch.onnx.export(module, (torch.randn(2, 3, D),), f, dynamo=False, opset_version=18, input_names=["x"],
                      output_names=["token"], dynamic_axes={"x": {0: "B", 1: "T"}, "token": {0: "B", 1: "T"}},
                      custom_opsets={DOMAIN: 1, "com.microsoft": 1})
    proto = onnx.load(f)
    assert expand_certified(proto) == 1
    assert {n.op_type for n in proto.graph.node} >= {"MatMulNBits", "TopK", "If"}
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _inputs(n: int, seed: int = 1) -> np.ndarray:
    """[n, D] hidden states with what makes int8 rounding hardest: outlier channels, tiny and huge scales."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, D)).astype(np.float32)
    x[::3, rng.integers(0, D, 4)] *= 40  # outlier channels set a block's scale
    x[1::5] *= 1e-3
    x[2::7] *= 300
    return x


def _coarse(h: CertifiedHead, x: np.ndarray) -> np.ndarray:
    """[M, V] float64: the coarse logits as the graphs compute them (MatMulNBits, 8 bits, int8 activations)."""
    s = ort.InferenceSession(coarse_model(h).SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, {"x": x})[0].astype(np.float64)


def _bound(h: CertifiedHead, x: np.ndarray) -> np.ndarray:
    amax = np.abs(x).reshape(len(x), D // BLOCK, BLOCK).max(-1).astype(np.float64)
    return amax @ h.bound.double().numpy()


@pytest.mark.parametrize("q8", [True, False], ids=["q8-exact-head", "float-head"])
def test_the_bound_holds_on_onnx_runtimes_own_kernel(q8):
    """|MatMulNBits(x) - x . W| <= amax_blocks(|x|) @ bound for every token, on the kernel the graphs run (int8
    activations), for a head its codes hold exactly and for one they do not."""
    w = _weight(3, q8)
    h = CertifiedHead(w)
    x = _inputs(64)
    coarse = _coarse(h, x)
    exact = x.astype(np.float64) @ w.double().numpy().T
    assert (np.abs(coarse - exact) <= _bound(h, x)).all()
    assert np.abs(coarse - exact).max() > 0  # (int8 activations do round)


def test_what_the_top_16_cannot_prove_the_top_64_does(tmp_path):
    """30 tokens a hair below the top (closer than the bound): the top 16 upper bounds cannot prove the argmax,
    the top 64 can (export/certified_graph.py's second level), and the graph's token is the exact argmax."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal(D).astype(np.float32)
    w = torch.from_numpy(rng.standard_normal((V, D)).astype(np.float32) * 1e-3)
    unit = torch.from_numpy(x / float(x @ x))
    w[11] += 10.0 * unit  # the argmax: logit ~10
    for i in range(100, 130):
        w[i] += 9.995 * unit  # 30 tokens at ~9.995
    m = _Argmax(w)
    upper = _coarse(m.head, x[None]) + _bound(m.head, x[None])
    order = np.argsort(-upper[0])
    exact = w.double().numpy() @ x.astype(np.float64)
    assert upper[0, order[16]] >= exact.max() > upper[0, order[64]]  # unproven at 16, proven at 64
    assert _session(m, tmp_path).run(None, {"x": x[None, None]})[0][0, 0] == exact.argmax()


def test_proven_and_fallback_rows_give_the_full_heads_argmax(tmp_path):
    w = _weight(4)
    m = _Argmax(w)
    s = _session(m, tmp_path)
    x = _inputs(40, seed=2).reshape(4, 10, D)
    want = (torch.from_numpy(x).double() @ w.double().t()).argmax(-1).numpy()
    assert (s.run(None, {"x": x})[0] == want).all()  # (the proven path, or the fallback where a row is not proven)
    m.head.bound.fill_(1e6)  # nothing can be proven: every call takes the full head
    assert (_session(m, tmp_path).run(None, {"x": x})[0] == want).all()
    m.head.bound.zero_()  # a bound of 0 trusts the coarse ranking: proven, and its rescored argmax still exact here
    assert (_session(m, tmp_path).run(None, {"x": x})[0] == want).all()


def test_a_tie_goes_to_the_lowest_id_on_both_paths(tmp_path):
    """Two tokens with the same weight row tie exactly: the lower id wins, as ArgMax over the full head picks it."""
    w = _weight(5)
    x = _inputs(6, seed=3)
    top = int((torch.from_numpy(x[0]) @ w.t()).argmax())
    w[top + 7 if top + 7 < V else top - 7] = w[top]
    lo = min(top, top + 7 if top + 7 < V else top - 7)
    m = _Argmax(w)
    for bound in (None, 1e6):  # proven, then forced onto the fallback
        if bound is not None:
            m.head.bound.fill_(bound)
        got = _session(m, tmp_path).run(None, {"x": x[None, :1]})[0]
        assert got[0, 0] == lo == int(m(torch.from_numpy(x[None, :1]))[0, 0])


def test_a_rows_token_does_not_depend_on_the_other_rows(tmp_path):
    """A 1-row call that is proven and the same row inside a call that falls back (an all-zero row cannot be
    proven: every token ties) give the same token, bit for bit from the same rescored dot products."""
    w = _weight(6, q8=True)
    s = _session(_Argmax(w), tmp_path)
    x = _inputs(12, seed=4)
    for r in range(12):
        alone = s.run(None, {"x": x[None, r:r + 1]})[0][0, 0]
        mixed = np.stack([np.zeros(D, np.float32), x[r], x[(r + 1) % 12]])[None]
        together = s.run(None, {"x": mixed})[0][0]
        assert together[0] == 0 and together[1] == alone


def test_only_a_float32_head_gets_one():
    lin = nn.Linear(D, V, bias=False)
    assert isinstance(certified_head(lin), CertifiedHead)
    assert certified_head(nn.Linear(D, V, bias=False).to(torch.bfloat16)) is None
    assert certified_head(nn.Linear(D + 8, V, bias=False)) is None  # not whole blocks
    assert certified_head(QuantLinear(lin, QuantSpec(bits=8, block_size=32, symmetric=True))) is None
    x = torch.randn(2, 3, D)
    assert torch.equal(certified_head(lin)(x, lin.weight), (x @ lin.weight.t()).argmax(-1))  # eager: the full head
