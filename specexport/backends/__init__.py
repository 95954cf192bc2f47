"""Engines: one model's compiled steps (steps.py) over its own static KV buffers.

The runtime only talks to this protocol, so the torch, TorchScript and onnxruntime engines are
interchangeable. It takes and returns numpy arrays (the torch engines convert at their own boundary, so the
onnxruntime path never imports torch). A call with batch B uses rows row0..row0+B-1 of the engine's caches
(row0 = 0 for a step over the whole batch; a request joining a running batch is prefilled in its own row).
Outputs of fixed-shape engines may be views of the engine's own buffers: read them before the next call of the
same step.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ..models.config import ModelConfig
from ..sampling import SamplingRows


class Engine(Protocol):
    config: ModelConfig
    vocab_size: int  # the model's own logits width
    fixed_shapes: bool  # True: prefill chunks are exactly C tokens and k is one of `ks` (compiled graphs)
    ks: tuple[int, ...] | None  # the k values with draft/verify graphs (None: any k, eager)

    def prefill(self, tokens: np.ndarray, past_len: np.ndarray, last_index: np.ndarray,
                kv_len: int, row0: int = 0) -> np.ndarray:
        """tokens [B, C] int64 at positions past_len + arange(C) -> logits [B, V] float32 at last_index [B]."""

    def draft(self, last_two: np.ndarray, past_len: np.ndarray, kv_len: int, k: int,
              sampling: SamplingRows | None, u: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """last_two [B, 2] (previous, current) -> draft [B, k] and q [B, k, V] (None when sampling is None).
        An engine that runs a draft as a chain of one-pass calls (OrtEngine with the fused set: `fused`) also takes
        until(drafts [B, i], margin [B, i] or None) -> bool, asked before each further pass: True ends the chain with
        [B, i]; margin is each draft's top logit minus its runner-up, where the engine reports it."""

    def verify(self, tokens: np.ndarray, draft_len: np.ndarray, past_len: np.ndarray, kv_len: int, k: int,
               sampling: SamplingRows | None, u: np.ndarray, q: np.ndarray | None):
        """tokens [B, k+1] = [current, draft] -> n_accepted [B], next [B], committed [B, k+1] (-1 padded).
        sampling None: all rows greedy. q None with sampling: one-hot drafts. u: [B, k+1] float32."""
