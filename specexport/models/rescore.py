"""A quantized copy's lm_head, rescored: cheap coarse logits, then the top candidates' logits exact.

A draft's lm_head is a 49k x 576 matrix on SmolLM2 that every draft pass reads whole. Its argmax only has to be
right among a few candidates, and those few can be scored exactly. So the copy keeps a coarse head (`coarse`, a
4-bit QuantLinear: half the bytes of an 8-bit one), takes its top `n` logits, and recomputes them from the
target's own float head (`exact`: the target's tensor, shared, never copied) over the copy's final hidden state:

    logits = coarse(x)                        [..., V]
    top    = topk(logits, n).indices          [..., n]
    logits[top] = (x * scale) . exact[top]    the n candidates' logits, in fp32

`scale` [D] undoes the smoothing folded into the copy's final norm (models/smooth.py: x = x_target / s), so the
rescored logits are the target head's over the copy's hidden state. The other V - n logits stay coarse: a greedy
draft picks among the candidates unless the coarse head ranks the right token below n; a sampling draft's q is
the distribution of these logits, whatever they are (lossless either way: the verify decides). A sampling pass
rescores SAMPLING_TOP = 256, so less of q's mass sits on coarse logits: at T = 0.7 a coarse tail cost acceptance
(README "Sampling graphs").

Measured on SmolLM2's smoothed int8:b128 copy (teacher-forced top-1 agreement with the fp32 target, held-out
replay prompts, MatMulNBits' int8 input rounding emulated; README "Quantized-copy drafts"): with its own 8-bit head
0.978; with an fp32 head 0.982; a 4-bit b128 head alone 0.787, its top 16 rescored 0.981 (b32: 0.874 alone, top 8
rescored 0.982). At near-ties (margin < 0.15), rescoring the 8-bit head's top 2 picked the target's token 0.78 of
the time against 0.73. ONNX: MatMulNBits, TopK, Gather, Mul, ReduceSum, ScatterElements.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import QuantSpec
from .quant import QuantLinear

BLOCK = 128  # the coarse head's quantization block (asymmetric)
TOP = 16  # candidates rescored exactly
SAMPLING_TOP = 256  # ... in a sampling pass, whose q is the whole distribution, not only its argmax
COARSE = "lm_head.coarse"  # the coarse head's name in a manifest's quant_layers: the mark of a rescored head


class RescoredHead(nn.Module):
    """coarse: the copy's quantized head; exact [V, D]: the target's float head weight (shared); scale [D]."""

    def __init__(self, coarse: QuantLinear | nn.Linear, exact: torch.Tensor, scale: torch.Tensor, n: int = TOP):
        super().__init__()
        assert exact.shape == (coarse.out_features, coarse.in_features) and scale.shape == (coarse.in_features,)
        self.coarse, self.n = coarse, min(n, exact.shape[0])
        self.sampling = False  # set by each step (steps._Step._head_mode): a sampling pass rescores SAMPLING_TOP
        self.register_buffer("exact", exact)
        self.register_buffer("scale", scale.detach().float().contiguous())
        self.out_features, self.in_features = exact.shape

    @classmethod
    def shell(cls, V: int, D: int, n: int | None = None) -> "RescoredHead":
        """Placeholders for an engine's torch backend: quant.apply_quant_layers puts the coarse QuantLinear in,
        load_state_dict the buffers."""
        return cls(nn.Linear(D, V, bias=False), torch.empty(V, D), torch.ones(D), n or TOP)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., V]
        logits = self.coarse(x).float()
        n = min(SAMPLING_TOP, self.out_features) if self.sampling else self.n
        top = logits.topk(n, -1).indices  # [..., n]
        rows = self.exact[top]  # [..., n, D]: n rows gathered
        exact = (rows * (x.float() * self.scale).unsqueeze(-2)).sum(-1)  # [..., n]
        return logits.scatter(-1, top, exact)


def rescored_head(head: nn.Linear, bits: int, target: nn.Module, copy: nn.Module) -> RescoredHead:
    """The copy's rescored head: `head` (its float head, smoothed) quantized at `bits` as the coarse one, the
    target's head weight as the exact one, the scale from the two models' final norms."""
    coarse = QuantLinear(head, QuantSpec(bits=bits, block_size=BLOCK, symmetric=False))
    return RescoredHead(coarse, target.lm_head.weight, head_scale(target.model.norm.weight, copy.model.norm.weight))


def head_scale(target_norm: torch.Tensor, copy_norm: torch.Tensor) -> torch.Tensor:
    """[D] the factors the copy's final norm was divided by (smoothing): x_target = x_copy * scale (1 where the
    copy's norm weight is 0: that channel is 0 either way)."""
    return torch.where(copy_norm != 0, target_norm / copy_norm, torch.ones_like(copy_norm)).float()
