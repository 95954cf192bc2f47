"""Host-side sampling, in numpy: the per-row sampling parameters the engines take (`SamplingRows`), each
request's random stream (`row_stream`), and the first token after prefill (`process_logits` + `sample_from`).

The verifier's own rule runs inside the step graphs (verify.py, torch); these numpy ports do the one draw that
happens on the host, from the prefill logits, and follow verify.py's rounding where it matters: torch's CPU
cumsum accumulates float32 in float64, so these do too (top-p cut-offs and inverse-CDF bins land alike).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SamplingRows:
    """Per-row sampling parameters as arrays (greedy rows carry temperature 1)."""

    temperature: np.ndarray  # [B] float32
    top_k: np.ndarray  # [B] int64
    top_p: np.ndarray  # [B] float32
    greedy: np.ndarray  # [B] bool

    def as_tuple(self) -> tuple[np.ndarray, ...]:
        return self.temperature, self.top_k, self.top_p, self.greedy


def row_stream(seed: int) -> np.random.Generator:
    """A request's random stream: the runtime draws every uniform the engines take from it (float32 in [0, 1)),
    so the same seed gives the same tokens on every backend."""
    return np.random.Generator(np.random.PCG64(seed))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _cumsum(x: np.ndarray) -> np.ndarray:
    return np.cumsum(x, axis=-1, dtype=np.float64).astype(np.float32)


def process_logits(logits: np.ndarray, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """verify.process_logits in numpy: temperature, then top-k, then top-p (transformers' order; ties with the
    k-th largest or with the smallest kept logit are kept). logits [B, V]; temperature, top_k, top_p [B]
    (top_k 0 and top_p 1 are off). returns probs [B, V] float32."""
    B, V = logits.shape
    assert temperature.shape == top_k.shape == top_p.shape == (B,)
    x = logits.astype(np.float32) / np.maximum(temperature, 1e-6).astype(np.float32)[:, None]
    if (top_k > 0).any() or (top_p < 1.0).any():
        sorted_x = -np.sort(-x, axis=-1)  # [B, V] descending
        kk = np.minimum(np.where(top_k > 0, top_k, V), V)
        kth = np.take_along_axis(sorted_x, (kk - 1)[:, None], -1)  # [B, 1]
        x = np.where(x < kth, -np.inf, x).astype(np.float32)
        sorted_x = np.where(sorted_x < kth, -np.inf, sorted_x).astype(np.float32)
        sorted_p = _softmax(sorted_x)
        mass_before = np.pad(_cumsum(sorted_p)[:, :-1], ((0, 0), (1, 0)))  # [B, V]: the running sum before each
        keep = ((mass_before < top_p.astype(np.float32)[:, None]) | (top_p >= 1.0)[:, None]
                | (np.arange(V) == 0)[None])
        n_keep = keep.sum(-1)  # [B]
        threshold = np.take_along_axis(sorted_x, (n_keep - 1)[:, None], -1)  # [B, 1]
        x = np.where(x < threshold, -np.inf, x).astype(np.float32)
    return _softmax(x)


def sample_from(probs: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse-CDF sampling (verify.sample_from). probs [B, V] (unnormalised is fine); u [B] in [0, 1).
    returns [B] int64."""
    cdf = _cumsum(probs)
    x = u.astype(np.float32) * cdf[:, -1]
    return np.minimum((cdf <= x[:, None]).sum(-1), probs.shape[-1] - 1).astype(np.int64)
