"""Engines: one model's fixed-shape forward over its own static KV buffers.

The runtime only ever talks to this protocol, so the torch, onnxruntime and tensorrt engines are
interchangeable. Rows 0..B-1 of the engine's cache are used by a call with batch B.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..models import LoadedModel, ModelConfig


class Engine(Protocol):
    config: ModelConfig
    vocab_size: int
    fixed_shapes: bool  # True: prefill chunks must be exactly C tokens (exported graphs); False: eager torch

    def forward(self, tokens: torch.Tensor, past_len: torch.Tensor, kv_len: int,
                logits_index: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T] at positions past_len[b] + arange(T) -> logits [B, T, V] fp32 ([B, 1, V] with
        logits_index [B]). Writes the new KV in place; kv_len bounds the attended cache prefix."""


def make_engine(loaded: LoadedModel, backend: str, max_batch: int, cache_len: int) -> Engine:
    if backend == "torch":
        from .torch_engine import TorchEngine
        return TorchEngine(loaded, max_batch, cache_len)
    raise ValueError(f"unknown backend {backend!r}")  # DecoderConfig validates user input before this
