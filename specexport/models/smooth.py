"""Activation smoothing for a quantized copy whose linears take int8 activations (SmoothQuant, Xiao et al. 2023).

MatMulNBits at accuracy_level 4 rounds each block of a linear's input to int8 at max|x| / 127 of the block. A few
channels far larger than the rest set that scale, and the others lose their precision: the int8:b128 copy's
teacher-forced agreement with its target is 0.988 with fp32 inputs and 0.960 with int8 ones (README, stop 32).
Smoothing moves that range into the weights, which 8-bit codes hold easily. Input channel j of a linear is divided
by s_j = max|x_j|^alpha / max|W[:, j]|^(1 - alpha) and W's column j is multiplied by it, so W x is unchanged in
exact arithmetic. The division folds into what feeds the linear:
  - q/k/v (fused): the input norm's weight;    gate/up (fused): the post-attention norm's weight;
  - down: up's rows (and bias), since silu(gate) * up is linear in up;    lm_head: the final norm's weight.
o_proj is left as it is: its input is attention over the cache's values, which the copy shares with its target.
max|x_j| comes from the target's own calibration text (calibration.py). It is a build-time transform: the copy's
codes and its own norm weights carry it, and nothing runs differently.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from .calibration import calibration_texts
from .decoder import KVCache, StaticKVDecoder
from .loading import LoadedModel
from .quant import dequantize_model

FLOOR = 1e-3  # a channel's range (and a column's weight range) counts as at least this share of the largest


@torch.inference_mode()
def input_ranges(model: StaticKVDecoder, texts: list[tuple[list[int], int]]) -> dict[str, torch.Tensor]:
    """max |x| per input channel of each linear that smoothing changes, over the texts (teacher-forced, one
    pass each): keys '<layer>.qkv', '<layer>.gate_up', '<layer>.down' and 'lm_head'."""
    ranges: dict[str, torch.Tensor] = {}

    def keep(key: str, x: torch.Tensor) -> None:
        r = x.reshape(-1, x.shape[-1]).abs().amax(0).float()
        ranges[key] = torch.maximum(ranges[key], r) if key in ranges else r

    def mlp_inputs(i: int, mlp: nn.Module):
        def hook(_module, _args, x):  # the post-attention norm's output: gate/up's input, and from it down's
            keep(f"{i}.gate_up", x)
            gate, up = F.linear(x, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias).split(mlp.down_proj.in_features, -1)
            keep(f"{i}.down", F.silu(gate) * up)
        return hook

    hooks = [model.model.norm.register_forward_hook(lambda _m, _a, x: keep("lm_head", x))]
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.input_layernorm.register_forward_hook(lambda _m, _a, x, i=i: keep(f"{i}.qkv", x)))
        hooks.append(layer.post_attention_layernorm.register_forward_hook(mlp_inputs(i, layer.mlp)))
    try:
        for ids, _ in texts:
            cache = KVCache.allocate(model.cfg, 1, len(ids), next(model.parameters()).dtype)
            model(torch.tensor([ids]), torch.zeros(1, dtype=torch.long), cache, len(ids))
    finally:
        for h in hooks:
            h.remove()
    return ranges


def _factors(x_range: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """s [in] for a linear's weight [out, in]: max|x_j|^alpha / max|W[:, j]|^(1 - alpha), both floored."""
    w = weight.abs().amax(0).float()
    x = x_range.clamp_min(float(x_range.max()) * FLOOR)
    w = w.clamp_min(float(w.max()) * FLOOR)
    return (x ** alpha / w ** (1 - alpha)).to(weight.dtype)


@torch.no_grad()
def smooth(model: StaticKVDecoder, ranges: dict[str, torch.Tensor], alpha: float) -> StaticKVDecoder:
    """In place, on a float copy (fused: qkv_proj, gate_up_proj) about to be quantized: see the module docstring.
    A tied lm_head gets its own weight first, so the embedding stays the target's."""
    for i, layer in enumerate(model.model.layers):
        qkv, mlp = layer.self_attn.qkv_proj, layer.mlp
        s = _factors(ranges[f"{i}.qkv"], qkv.weight, alpha)
        layer.input_layernorm.weight.div_(s)
        qkv.weight.mul_(s)
        s = _factors(ranges[f"{i}.gate_up"], mlp.gate_up_proj.weight, alpha)
        layer.post_attention_layernorm.weight.div_(s)
        mlp.gate_up_proj.weight.mul_(s)
        n = mlp.down_proj.in_features  # gate_up's rows n.. are up's
        s = _factors(ranges[f"{i}.down"], mlp.down_proj.weight, alpha)
        mlp.gate_up_proj.weight[n:].div_(s[:, None])
        if mlp.gate_up_proj.bias is not None:
            mlp.gate_up_proj.bias[n:].div_(s)
        mlp.down_proj.weight.mul_(s)
    if model.lm_head.weight is model.model.embed_tokens.weight:
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone(), requires_grad=False)
    s = _factors(ranges["lm_head"], model.lm_head.weight, alpha)
    model.model.norm.weight.div_(s)
    model.lm_head.weight.mul_(s)
    return model


def smoothed_copy(target: LoadedModel, alpha: float) -> StaticKVDecoder:
    """A float copy of the target's model (a GGUF target's codes as stored dequantized, as quantize_model would),
    smoothed on its calibration text, to quantize next."""
    model = dequantize_model(copy.deepcopy(target.model))
    return smooth(model, input_ranges(model, calibration_texts(target)), alpha)
