"""Drafters: one narrow protocol and one flat factory.

A drafter proposes k tokens per row after the current token (see verify.py for the words) as a Proposal:
  draft     [B, k] long   proposed tokens (padding where it has nothing to say)
  q         [B, k, V]     processed draft probabilities, or None for one-hot drafters (prompt lookup)
  draft_len [B] long      how many of the k are real proposals; padding is never accepted
  source    [B] int       where each row's proposal came from, for acceptance kept per source (autok.py):
                          prompt lookup's matched n-gram length (0: no match); a draft model: 0
Kinds: a draft model of any supported family, prompt lookup (n-gram), and a quantized copy of the target
(`quant:int4` / `quant:int8[:b<block>][:sym|:asym]`, models/quant.py), which runs as a draft model.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from .config import PROMPT_LOOKUP, DecoderConfig
from .errors import SpecExportError
from .models import LoadedModel, load_model, read_config, resolve_path
from .models.quant import QuantSpec, is_quant_spec, quantize_model
from .steps import SamplingRows


@dataclass
class DraftInputs:
    """What the runtime shows a drafter each step (B active slots)."""

    last_two: torch.Tensor  # [B, 2] long: the previous and the current committed token
    past_len: torch.Tensor  # [B] long: the current token's position
    kv_len: int  # max(past_len) + k + 1 on the host
    history: np.ndarray  # [B, max_seq_len] int64: committed tokens, current included
    lengths: list[int]  # valid length of each history row
    sampling: SamplingRows | None  # None: every row greedy
    u_draft: torch.Tensor  # [B, k] uniforms for sampling the drafts


@dataclass
class Proposal:
    draft: torch.Tensor  # [B, k] long
    q: torch.Tensor | None  # [B, k, V] processed draft probs; None: one-hot at `draft`
    draft_len: torch.Tensor  # [B] long: real proposals per row; the rest is padding
    longest: int  # max(draft_len), known on the host without a device sync
    source: list[int] | None = None  # [B] per-row proposal source (None: one source, 0)


class Drafter(Protocol):
    name: str

    def prefill(self, tokens: torch.Tensor, past_len: torch.Tensor, kv_len: int, row0: int = 0) -> None:
        """See prompt chunks as the target does ([B, C] at positions past_len + arange(C), rows row0..)."""

    def propose(self, x: DraftInputs, k: int) -> Proposal:
        """k tokens per row after the current token."""


class ModelDrafter:
    """A smaller model with the target's vocabulary, over its own static KV buffers (an Engine).

    Its cache mirrors the target's positions. Each step its fused draft graph re-reads the last two
    committed tokens (positions past_len-1, past_len): that fills the one position it may not have seen
    (the last accepted draft when all k were accepted) and rewrites the other with identical keys and values.
    """

    def __init__(self, engine, name: str):
        self.engine = engine
        self.name = name

    def prefill(self, tokens, past_len, kv_len, row0=0):
        self.engine.prefill(tokens, past_len, torch.zeros_like(past_len), kv_len, row0)

    def propose(self, x: DraftInputs, k: int):
        B = x.last_two.shape[0]
        draft, q = self.engine.draft(x.last_two, x.past_len, x.kv_len, k, x.sampling, x.u_draft)
        return Proposal(draft, q, torch.full((B,), k, dtype=torch.long), k)


class PromptLookupDrafter:
    """N-gram drafts: find an earlier occurrence of the last n tokens (n from ngram_max down to ngram_min)
    in the prompt and generated text, and propose up to k tokens that followed it (the latest occurrence
    with k followers, else the earliest, which has the most). One-hot q."""

    def __init__(self, ngram_min: int = 1, ngram_max: int = 3):
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.name = PROMPT_LOOKUP

    def prefill(self, tokens, past_len, kv_len, row0=0):
        pass

    def lookup(self, seq: np.ndarray, k: int) -> tuple[np.ndarray, int]:
        """seq: [L] committed tokens -> (up to k proposed tokens, the matched n-gram length n; 0: none).
        One pass finds the earlier occurrences of the last token; each longer n-gram filters those."""
        L = len(seq)
        if L < 2:
            return seq[:0], 0
        ends = np.flatnonzero(seq[:-1] == seq[-1])  # [m] end positions of 1-gram matches (the suffix excluded)
        found, n = None, 0
        for m in range(1, min(self.ngram_max, L - 1) + 1):
            if m > 1:  # keep the ends whose match extends one token further back
                ends = ends[ends >= m - 1]
                ends = ends[seq[ends - (m - 1)] == seq[L - m]]
            if not len(ends):
                break
            if m >= self.ngram_min:
                found, n = ends, m
        if found is None:
            return seq[:0], 0
        full = found[found + 1 + k <= L]  # prefer the latest match that has k tokens after it, else the earliest
        start = (full[-1] if len(full) else found[0]) + 1
        return seq[start:start + k], n

    def propose(self, x: DraftInputs, k: int):
        B = x.last_two.shape[0]
        draft = np.zeros((B, k), dtype=np.int64)
        draft_len = np.zeros(B, dtype=np.int64)
        source = [0] * B
        for b in range(B):
            found, source[b] = self.lookup(x.history[b, :x.lengths[b]], k)
            draft[b, :len(found)] = found
            draft_len[b] = len(found)
        return Proposal(torch.from_numpy(draft), None, torch.from_numpy(draft_len), int(draft_len.max()), source)


def check_vocab(target: LoadedModel, draft: LoadedModel) -> None:
    """The draft must share the target's vocabulary; padded embedding tails are allowed (and masked)."""
    tt, dt = target.tokenizer, draft.tokenizer
    vt, vd = target.config.vocab_size, draft.config.vocab_size
    if tt is not None and dt is not None:
        a, b = tt.get_vocab(), dt.get_vocab()
        if a != b:
            diff = sorted(set(a.items()) ^ set(b.items()))
            raise SpecExportError(
                f"draft vocabulary differs from the target's ({len(diff)} token/id pairs differ, e.g. {diff[0]}): "
                "choose a draft that uses the target's tokenizer")
        real = len(tt)
        if min(vt, vd) < real:
            raise SpecExportError(f"embedding sizes {vt} (target) and {vd} (draft) cannot both hold the "
                                  f"{real}-token vocabulary: choose a draft that uses the target's tokenizer")
    elif vt != vd:
        raise SpecExportError(f"draft vocabulary size {vd} differs from the target's {vt} and there is no "
                              "tokenizer to show the tail is padding: choose a draft with the target's vocabulary")


def make_drafter(spec: str | None, target: LoadedModel, cfg: DecoderConfig, make_engine) -> Drafter:
    """spec: None or 'prompt-lookup' -> n-gram; 'quant:int8|int4' -> quantized target copy; else a model path.
    make_engine(loaded) builds the draft's engine."""
    if spec is None or spec == PROMPT_LOOKUP:
        return PromptLookupDrafter(cfg.ngram_min, cfg.ngram_max)
    loaded = load_draft(spec, target, cfg)
    return ModelDrafter(make_engine(loaded), name=loaded.source)


def quantized_copy(target: LoadedModel, spec: QuantSpec) -> LoadedModel:
    """The target's own weights, every linear layer block-quantized (models/quant.py)."""
    model = quantize_model(copy.deepcopy(target.model), spec)
    return LoadedModel(model, target.config, target.tokenizer, spec.name)


def load_draft(spec: str, target: LoadedModel, cfg: DecoderConfig, gguf_stored: bool = False,
               accuracy_level: int = 4) -> LoadedModel:
    """Load a draft model and check that it fits the target (before any heavy work on it). gguf_stored: a GGUF
    draft keeps its quantized weights as stored (see load_model)."""
    if is_quant_spec(spec):
        return quantized_copy(target, QuantSpec.parse(spec))
    path = resolve_path(spec, role="draft")
    read_config(path)  # unsupported architectures fail here, before the weights load
    loaded = load_model(path, cfg.dtype, cfg.cache_len, role="draft", gguf_stored=gguf_stored,
                        accuracy_level=accuracy_level)
    check_vocab(target, loaded)
    return loaded
