"""The target's greedy argmax without reading its whole lm_head: a coarse 8-bit head, a proven error bound, the top
candidates rescored exactly, and the full head only where the bound cannot prove the answer.

An fp32 SmolLM2 step reads 425 MB of layer weights and 113 MB of lm_head (49,152 x 576), but a greedy step only
needs the head's argmax. Here (ONNX Runtime's fused greedy graphs; export/certified_graph.py writes the nodes):

    coarse[i] = MatMulNBits(x, codes)[i]          8-bit b32 symmetric codes of W (28 MB), int8 activations
    err[i]   <= sum_b amax_b(|x|) * bound[b, i]   a proven bound on |coarse[i] - x . W[i]|
    cand      = the top n of coarse + err         the only tokens whose exact logit can reach the top
    exact     = x . W[cand]                       the n candidates in fp32, from the target's own W
    token     = argmax(exact), lowest id on a tie (as ArgMax over the full head)

The answer is proven when the best candidate's exact logit exceeds the (n+1)-th upper bound: every other token's
exact logit is below its upper bound, which is below that. Where some row is not proven, an If rescores the top 64
upper bounds the same way, and where even that proves nothing, runs the full head (FusedMatMul) and rescores its
top n. Whichever level answers, a row's token is the argmax of the
same fp32 dot products (ReduceSum over [.., n, D], bit for bit the same whatever the row count or n) over a set
holding every token near the top, so a 1-row target-only step and a (k+1)-row verify give the same token.

The bound, per block b of 32 input channels (x^ the kernel's int8 input, W^ the dequantized codes):
    coarse - exact = sum W^ (x^ - x) + sum (W^ - W) x
    |.| <= sum_b amax_b / 254 * |W^[i, b]|_1 + |x_b|_1 * max|W^[i, b] - W[i, b]|
        <= sum_b amax_b * (|W^[i, b]|_1 / 254 + 32 * max|W^[i, b] - W[i, b]|)
(MLAS rounds each block of 32 inputs to int8 at amax_b / 127: half a step is amax_b / 254), times SAFETY for the
fp32 rounding of both sums, rounded up to fp32. On SmolLM2 (whose fp32 head is the GGUF's Q8_0 codes, so W^ = W),
over the 3,072 positions of the fp32 target's greedy continuations of the bench prompts, ONNX Runtime's kernel
erred by at most 0.19 of the bound, and every position was proven with n = 16 (n = 8: 99.0%; README).

Sampling graphs and the prefill keep the full head: they need every logit. Eagerly the module is the full head's
argmax (the reference the graphs must equal).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import QuantSpec
from .quant import dequantize_weight, quantize_weight

BITS, BLOCK, TOP = 8, 32, 16
SAFETY = 1.25  # headroom over the bound for the fp32 rounding of the kernel's and the rescoring's sums
SPEC = QuantSpec(bits=BITS, block_size=BLOCK, symmetric=True)
MARK = "CertifiedArgmax"  # the one node export writes (domain "specexport"), expanded by export/certified_graph.py


class CertifiedHead(nn.Module):
    """Buffers: codes uint8 [V, nb, 32] and scales [V * nb] (MatMulNBits' layout), bound [nb, V]. The exact weight
    is the target's lm_head weight, passed to forward (a traced parameter, so the graphs read the one tensor)."""

    def __init__(self, weight: torch.Tensor, n: int = TOP):
        super().__init__()
        V, D = weight.shape
        assert D % BLOCK == 0, f"certified head: hidden size {D} is not a multiple of {BLOCK}"
        self.n = min(n, V - 1)
        q = quantize_weight(weight.detach(), SPEC)
        w = weight.detach().double().reshape(V, D // BLOCK, BLOCK)
        coarse = dequantize_weight(q, SPEC, D).double().reshape(V, D // BLOCK, BLOCK)
        bound = SAFETY * (coarse.abs().sum(-1) / 254.0 + BLOCK * (coarse - w).abs().amax(-1))  # [V, nb]
        self.register_buffer("codes", q["qweight"])
        self.register_buffer("scales", q["scales"])
        self.register_buffer("bound", _round_up(bound).t().contiguous())

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [..., D] -> [...] long
        return _CertifiedArgmax.apply(x, weight, self.codes, self.scales, self.bound, self.n)


class _CertifiedArgmax(torch.autograd.Function):
    """Eager: the full head's argmax. Exported: one specexport::CertifiedArgmax node (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, codes, scales, bound, n):
        return (x.float() @ weight.float().t()).argmax(-1)

    @staticmethod
    def symbolic(g, x, weight, codes, scales, bound, n):
        y = g.op(f"specexport::{MARK}", x, weight, codes, scales, bound, top_i=n, block_i=BLOCK, bits_i=BITS)
        sizes = x.type().varyingSizes()
        y.setType(x.type().with_dtype(torch.long).with_sizes(sizes[:-1] if sizes else None))
        return y


def certified_head(head: nn.Module) -> CertifiedHead | None:
    """The certified head for a model's lm_head, or None where there is nothing to gain or no float head to prove
    against: a quantized head (GGUF codes as stored, --target-quant), a head narrower than 8 bits already, a half
    precision model, a hidden size that is not a multiple of the block."""
    if type(head) is not nn.Linear or head.bias is not None or head.weight.dtype != torch.float32:
        return None
    if head.in_features % BLOCK or head.out_features <= TOP:
        return None
    return CertifiedHead(head.weight)


def _round_up(t: torch.Tensor) -> torch.Tensor:
    """float64 -> float32, each value rounded up (a bound must not shrink)."""
    f = t.float()
    return torch.where(f.double() < t, torch.nextafter(f, torch.tensor(float("inf"))), f)
