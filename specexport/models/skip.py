"""The target with fewer layers as a draft (`layers:` specs, models/layer_spec.py): the skipped layers pass the
residual stream through.

The draft is a StaticKVDecoder whose modules are the target's own objects (embedding, kept blocks, final norm,
lm_head): no weight is copied, and the build writes none of them twice (export/build.py shares identical tensors
with the target). Its KV cache holds only the kept layers. A quantized variant copies the kept blocks before
quantizing, so its linears hold only their codes and the target keeps its float weights.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from ..config import QuantSpec
from .decoder import StaticKVDecoder


def skip_layers(target: StaticKVDecoder, keep: tuple[int, ...]) -> StaticKVDecoder:
    """A decoder over the target's own modules with only `keep` layers (nothing is copied)."""
    assert keep and all(0 <= i < target.cfg.num_layers for i in keep), keep
    cfg = dataclasses.replace(target.cfg, num_layers=len(keep))
    with torch.device("meta"):  # the shell's own parameters are replaced below: allocate none
        draft = StaticKVDecoder(cfg, target.max_positions)
    draft.model.embed_tokens = target.model.embed_tokens
    draft.model.layers = nn.ModuleList(target.model.layers[i] for i in keep)
    draft.model.norm = target.model.norm
    draft.lm_head = target.lm_head
    draft._set_rope(target.rope_cos.dtype)
    return draft.eval().requires_grad_(False)


def quantized_skip(target: StaticKVDecoder, keep: tuple[int, ...], quant: str) -> StaticKVDecoder:
    """skip_layers with the kept blocks (and lm_head) copied and weight-only quantized; embedding and final norm
    stay the target's."""
    from .quant import quantize_model
    draft = skip_layers(target, keep)
    draft.model.layers = copy.deepcopy(draft.model.layers)
    draft.lm_head = copy.deepcopy(draft.lm_head)  # a tied lm_head gets its own codes; the embedding stays shared
    # (smoothing and the rescored head are for quant: copies only)
    return quantize_model(draft, dataclasses.replace(QuantSpec.parse(quant), smooth=0.0, head=0))
