"""Rotary position embeddings: inverse frequencies (default, linear, llama3) and the cos/sin tables."""

from __future__ import annotations

import math

import torch

from ..errors import SpecExportError
from .config import ModelConfig


def inv_freq(cfg: ModelConfig) -> torch.Tensor:  # [head_dim/2] fp32
    dim = cfg.head_dim
    base = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = cfg.rope_scaling
    if s is None:
        return base
    kind = s["rope_type"]
    if kind == "linear":
        return base / s["factor"]
    if kind == "llama3":
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / base
        scaled = torch.where(wavelen > old / lo, base / factor, base)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
        return torch.where(medium, smoothed, scaled)
    raise SpecExportError(f"rope scaling {kind!r} is not supported; supported: default, linear, llama3")


def rope_tables(cfg: ModelConfig, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [length, head_dim], laid out as HF's rotate_half expects (two halves repeated)."""
    pos = torch.arange(length, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq(cfg))  # [length, head_dim/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [length, head_dim]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; cos, sin: [B, 1, T, D]."""
    half = int(x.shape[-1]) // 2  # (a constant in exported graphs)
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
