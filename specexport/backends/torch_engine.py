"""The torch backend: eager PyTorch over preallocated KV buffers (the reference the others are tested against)."""

from __future__ import annotations

import torch

from ..models import KVCache, LoadedModel


class TorchEngine:
    fixed_shapes = False  # eager: the last prefill chunk runs unpadded

    def __init__(self, loaded: LoadedModel, max_batch: int, cache_len: int):
        self.model = loaded.model
        self.config = loaded.config
        self.vocab_size = loaded.config.vocab_size
        dtype = next(self.model.parameters()).dtype
        device = next(self.model.parameters()).device
        self.cache = KVCache.allocate(self.config, max_batch, cache_len, dtype, device)  # [max_batch, Hkv, S, D] each
        self.max_batch = max_batch

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, past_len: torch.Tensor, kv_len: int,
                logits_index: torch.Tensor | None = None) -> torch.Tensor:
        assert tokens.shape[0] <= self.max_batch, f"batch {tokens.shape[0]} > max_batch {self.max_batch}"
        return self.model(tokens, past_len, self.cache, kv_len, logits_index)
