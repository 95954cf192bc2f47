"""Weight-only block quantization of a decoder's linear layers: the quantized-copy drafter.

A weight W [N, K] (out, in) is cut along K into blocks of `block_size`; each block b of row n keeps one
scale s[n, b] and one integer zero point z[n, b], and each weight one unsigned `bits`-bit code c:

    W[n, k] ~= (c[n, k] - z[n, b]) * s[n, b],   b = k // block_size

symmetric:  z = 2**(bits-1) (not stored), s = max|W_block| / (2**(bits-1) - 1)
asymmetric: s = (max - min) / (2**bits - 1) over the block's range widened to hold 0, z = round(-min / s)

The layout is ONNX Runtime's MatMulNBits (com.microsoft) one, so export emits that op directly over the
stored codes: qweight uint8 [N, n_blocks, block_size * bits / 8] (4-bit: low nibble first), scales
[N * n_blocks] float, zero_points uint8 [N * ceil(n_blocks * bits / 8)] (4-bit packed likewise). K is padded
to a whole number of blocks with zero codes at the zero point (they dequantize to 0).

Eagerly (torch backend, the build check) a QuantLinear multiplies by its dequantized weight, made once; the
exported op computes with int8 activations (accuracy_level 4, MLAS's fast path), so eager and ONNX drafts may
differ in rare near-ties. That is harmless: drafts only propose, and the target's verification decides.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..config import QuantSpec
from ..errors import SpecExportError


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., n] integer codes in [0, 2**bits) -> uint8 [..., n * bits / 8], low nibble first for 4 bits."""
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes
    if codes.shape[-1] % 2:
        codes = F.pad(codes, (0, 1))
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    if bits == 8:
        return packed[..., :n].long()
    return torch.stack([packed & 15, packed >> 4], -1).flatten(-2)[..., :n].long()


def quantize_weight(w: torch.Tensor, spec: QuantSpec) -> dict[str, torch.Tensor]:
    """w [N, K] -> {'qweight' uint8 [N, nb, bs*bits/8], 'scales' f32 [N * nb], 'zero_points' uint8 (asym only)}."""
    N, K = w.shape
    bs, bits = spec.block_size, spec.bits
    nb = math.ceil(K / bs)
    blocks = F.pad(w.float(), (0, nb * bs - K)).reshape(N, nb, bs)  # [N, nb, bs]; padding is 0
    qmax = 2 ** bits - 1
    if spec.symmetric:
        half = 2 ** (bits - 1)
        scale = blocks.abs().amax(-1) / (half - 1)  # [N, nb]
        zero = torch.full_like(scale, half)
    else:
        lo, hi = blocks.amin(-1).clamp(max=0), blocks.amax(-1).clamp(min=0)  # the range holds 0
        scale = (hi - lo) / qmax
        zero = torch.where(scale > 0, -lo / scale.clamp_min(1e-30), 0.0).round().clamp(0, qmax)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block: any scale is exact
    codes = (blocks / scale[..., None] + zero[..., None]).round().clamp(0, qmax)
    out = {"qweight": _pack(codes, bits).contiguous(), "scales": scale.reshape(-1).contiguous()}
    if not spec.symmetric:
        out["zero_points"] = _pack(zero.long(), bits).reshape(-1).contiguous()
    return out


def dequantize_weight(q: dict[str, torch.Tensor], spec: QuantSpec, K: int) -> torch.Tensor:
    """The inverse of quantize_weight: [N, K] float32 = scale * (code - zero) (the product in GGUF's order)."""
    N, nb, _ = q["qweight"].shape
    bs = spec.block_size
    codes = _unpack(q["qweight"], spec.bits, bs).float()  # [N, nb, bs]
    if spec.symmetric:
        zero = torch.full((N, nb), 2.0 ** (spec.bits - 1))
    else:
        zero = _unpack(q["zero_points"].reshape(N, -1), spec.bits, nb).float()
    w = q["scales"].reshape(N, nb, 1) * (codes - zero[..., None])
    return w.reshape(N, nb * bs)[:, :K]


class _MatMulNBits(torch.autograd.Function):
    """Exported (legacy torch.onnx) as com.microsoft::MatMulNBits: x [..., K] -> [..., N]. Only traced: the value
    here just carries the shape (no dequantized weight becomes a trace constant, which made exports slow)."""

    @staticmethod
    def forward(ctx, x, qweight, scales, zero_points, K, N, bits, block_size, accuracy_level):
        return x.new_zeros(*x.shape[:-1], N)

    @staticmethod
    def symbolic(g, x, qweight, scales, zero_points, K, N, bits, block_size, accuracy_level):
        inputs = [x, qweight, scales] + ([zero_points] if zero_points is not None else [])
        y = g.op("com.microsoft::MatMulNBits", *inputs, K_i=K, N_i=N, bits_i=bits, block_size_i=block_size,
                 accuracy_level_i=accuracy_level)
        y.setType(x.type().with_sizes([*x.type().varyingSizes()[:-1], N]))  # [M, N]: shape inference's answer
        return y


class QuantLinear(nn.Module):
    """A bias-free nn.Linear replacement over block-quantized weights (see the module docstring): quantized here
    from a float layer, or holding a GGUF tensor's codes as stored (`from_codes`, models/gguf_quant.py)."""

    def __init__(self, lin: nn.Linear | None, spec: QuantSpec, shape: tuple[int, int] | None = None,
                 bias: torch.Tensor | None = None):
        super().__init__()
        if lin is not None:
            bias, shape = lin.bias, tuple(lin.weight.shape)
        if bias is not None:  # (qkv bias: qwen2) kept in float, added after the matmul
            self.bias = nn.Parameter(bias.detach().float(), requires_grad=False)
        else:
            self.bias = None
        self.spec = spec
        self.out_features, self.in_features = shape
        N, K, bs = shape[0], shape[1], spec.block_size
        nb = math.ceil(K / bs)
        if lin is not None:
            q = quantize_weight(lin.weight.detach(), spec)
        else:  # shells, filled by load_state_dict (or from_codes)
            q = {"qweight": torch.zeros(N, nb, bs * spec.bits // 8, dtype=torch.uint8),
                 "scales": torch.zeros(N * nb)}
            if not spec.symmetric:
                q["zero_points"] = torch.zeros(N * math.ceil(nb * spec.bits / 8), dtype=torch.uint8)
            if spec.mins:
                q["mins"] = torch.zeros(nb, N)  # transposed: the exported term is blocksum(x) [.., nb] @ mins
        for name, t in q.items():
            self.register_buffer(name, t)
        if spec.symmetric:
            self.zero_points = None
        if not spec.mins:
            self.mins = None
        self._weight: torch.Tensor | None = None  # the dequantized weight for eager runs, made on first use

    def float_linear(self) -> nn.Linear:
        """An nn.Linear over this layer's dequantized weight (and its bias)."""
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        lin.weight = nn.Parameter(self.dequantized(), requires_grad=False)
        if self.bias is not None:
            lin.bias = self.bias
        return lin

    @classmethod
    def from_codes(cls, bc, accuracy_level: int = 4, bias: torch.Tensor | None = None) -> "QuantLinear":
        """A layer over GGUF codes as stored (gguf_quant.BlockCodes): nothing is re-quantized. Minimums are kept
        pooled (times the block size: exact, a power of two), for the export's block means (`forward`)."""
        N, K = bc.shape
        nb = K // bc.block
        symmetric = bool((bc.zeros == 2 ** (bc.bits - 1)).all())
        spec = QuantSpec(bits=bc.bits, block_size=bc.block, symmetric=symmetric, accuracy_level=accuracy_level,
                         mins=bc.mins is not None, pooled=bc.mins is not None)
        layer = cls(None, spec, (N, K), bias)
        layer.qweight.copy_(_pack(torch.from_numpy(bc.codes).reshape(N, nb, bc.block), bc.bits))
        layer.scales.copy_(torch.from_numpy(bc.scales).reshape(-1))
        if not symmetric:
            layer.zero_points.copy_(_pack(torch.from_numpy(bc.zeros), bc.bits).reshape(-1))
        if bc.mins is not None:
            layer.mins.copy_(torch.from_numpy(np.ascontiguousarray(bc.mins.T)) * bc.block)
        return layer

    def block_mins(self) -> torch.Tensor:
        """[nb, out] float32: each block's minimum as GGUF stores it (the buffer holds block_size times it when
        the spec is `pooled`; dividing by a power of two gives it back exactly)."""
        return self.mins / self.spec.block_size if self.spec.pooled else self.mins

    def dequantized(self) -> torch.Tensor:
        """[out, in] float32: scale * (code - zero) (+ min), in that order (bit for bit GGUF's dequantize)."""
        if self._weight is None:
            q = {"qweight": self.qweight, "scales": self.scales}
            if self.zero_points is not None:
                q["zero_points"] = self.zero_points
            w = dequantize_weight(q, self.spec, self.in_features)
            if self.mins is not None:
                nb, N = self.mins.shape
                mins = self.block_mins().t()[..., None]
                w = (w[:, :nb * self.spec.block_size].reshape(N, nb, -1) + mins).reshape(N, -1)
            self._weight = w
        return self._weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out] (MatMulNBits takes any rank)
        s = self.spec
        if not torch.jit.is_tracing():  # eager: the dequantized weight
            y = x @ self.dequantized().t()
        else:  # exported: MatMulNBits over the codes (+ the block minimums' term; values here only give shapes)
            y = _MatMulNBits.apply(x, self.qweight, self.scales, self.zero_points, self.in_features,
                                   self.out_features, s.bits, s.block_size, s.accuracy_level)
            if self.mins is not None:  # sum_b min[n, b] * sum_{k in b} x[.., k]
                if s.pooled and x.dim() == 3:  # x [B, T, K] is (N, C, L) to a 1-D AveragePool: block means
                    xs = F.avg_pool1d(x, s.block_size, s.block_size)  # [B, T, nb]
                else:  # Reshape, ReduceSum (ReduceMean when pooled)
                    nb = int(self.mins.shape[0])
                    mid = [int(d) for d in x.shape[1:-1]]  # static (tokens per pass): no Shape/Slice/Concat chain
                    xs = x.reshape(-1, *mid, nb, s.block_size)
                    xs = xs.mean(-1) if s.pooled else xs.sum(-1)  # [..., nb]
                y = y + xs @ self.mins  # pooled: a block's mean times block_size * min is its sum times min, exactly
        return y if self.bias is None else y + self.bias


def quantize_model(model: nn.Module, spec: QuantSpec) -> nn.Module:
    """Replace every linear layer of a (fused) StaticKVDecoder, lm_head included, with a QuantLinear, in place
    (a layer that is already quantized, e.g. GGUF codes as stored, is re-quantized from its dequantized weight).
    The embedding stays in float (a gather reads one row per token); a tied lm_head gets its own codes."""
    if next(model.parameters()).dtype != torch.float32:
        raise SpecExportError("quantized models are built from fp32 weights: use --dtype fp32 (or omit --dtype)")
    for parent in list(dequantize_model(model).modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, QuantLinear(child, spec))
    return model


def dequantize_model(model: nn.Module) -> nn.Module:
    """In place: every QuantLinear (GGUF codes as stored, a --target-quant layer) back to an nn.Linear over its
    dequantized weight."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, QuantLinear):
                setattr(parent, name, child.float_linear())
    return model


def quant_layers(model: nn.Module) -> dict[str, dict]:
    """name -> QuantSpec fields of every QuantLinear (the manifest's record, to rebuild the shells at load)."""
    from dataclasses import asdict
    def record(spec: QuantSpec) -> dict:  # `pooled` only where set: older runtimes read the other records;
        # `smooth` and `head` never (a build-time transform the codes carry; the copy's head: rescore.py)
        return {k: v for k, v in asdict(spec).items() if k not in ("smooth", "head") and (k != "pooled" or v)}
    return {n: {**record(m.spec), "shape": [m.out_features, m.in_features], "bias": m.bias is not None}
            for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def apply_quant_layers(model: nn.Module, layers: dict[str, dict]) -> nn.Module:
    """Put QuantLinear shells (filled by load_state_dict) where `quant_layers` recorded them."""
    for name, rec in layers.items():
        rec = dict(rec)
        shape, bias = tuple(rec.pop("shape")), rec.pop("bias")
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, QuantLinear(None, QuantSpec(**rec), shape, torch.zeros(shape[0]) if bias else None))
    return model
