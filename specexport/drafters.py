"""Drafters: one narrow protocol and its runtime kinds (numpy; the factory from checkpoints is draft_models.py).

A drafter proposes k tokens per row after the current token (see verify.py for the words) as a Proposal:
  draft     [B, k] long   proposed tokens (padding where it has nothing to say)
  q         [B, k, V]     processed draft probabilities, or None for one-hot drafters (prompt lookup)
  draft_len [B] long      how many of the k are real proposals; padding is never accepted
  source    [B] int       where each row's proposal came from, for acceptance kept per source (specexport/autok):
                          prompt lookup's matched n-gram length (0: no match); a draft model: 0
Kinds: a draft model of any supported family, prompt lookup (n-gram), a quantized copy of the target
(`quant:int4` / `quant:int8[:b<block>][:sym|:asym]`, models/quant.py), which runs as a draft model, and the
hybrid of lookup and a model (`prompt-lookup+<model>`): per row, lookup's proposal where it matched at least
`min_match` tokens, the model's elsewhere; the model runs only when some row needs it. A draft model whose
engine runs one pass per call ends a row's drafts after a near-tie (ModelDrafter.propose: the margin stop).
Arrays are numpy (the Engine protocol's); draft_models.py builds drafters from checkpoints (torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .config import LAYERS_PREFIX, PROMPT_LOOKUP, QUANT_PREFIX
from .errors import SpecExportError
from .sampling import SamplingRows


@dataclass
class DraftInputs:
    """What the runtime shows a drafter each step (B active slots)."""

    last_two: np.ndarray  # [B, 2] int64: the previous and the current committed token
    past_len: np.ndarray  # [B] int64: the current token's position
    kv_len: int  # max(past_len) + k + 1 on the host
    history: np.ndarray  # [B, max_seq_len] int64: committed tokens, current included
    lengths: list[int]  # valid length of each history row
    sampling: SamplingRows | None  # None: every row greedy
    u_draft: np.ndarray  # [B, k] float32 uniforms for sampling the drafts


@dataclass
class Proposal:
    draft: np.ndarray  # [B, k] int64
    q: np.ndarray | None  # [B, k, V] float32 processed draft probs; None: one-hot at `draft`
    draft_len: np.ndarray  # [B] int64: real proposals per row; the rest is padding
    longest: int  # max(draft_len), known on the host without a device sync
    source: list[int] | None = None  # [B] per-row proposal source (None: one source, 0)
    model_ran: bool = False  # the draft model ran this step (its cache then holds every committed position)
    passes: int = 0  # draft-model passes run (k, or fewer where every model row handed over to lookup)
    handover: list[tuple[int, int] | None] | None = None  # [B] (j, n): the model drafted j tokens, lookup the
    #                                                       rest from an n-gram match (HybridDrafter); None: not
    margin: np.ndarray | None = None  # [B, passes - 1] each draft's top logit minus its runner-up, but the last's
    ties: tuple[int, int] = (0, 0)  # (near-ties, draft positions checked) of the model's chain (autok prices it)
    tied: np.ndarray | None = None  # [B] bool: the row's chain ended at a near-tie (its last draft is the tie)


class Drafter(Protocol):
    name: str

    def prefill(self, tokens: np.ndarray, past_len: np.ndarray, kv_len: int, row0: int = 0) -> None:
        """See prompt chunks as the target does ([B, C] at positions past_len + arange(C), rows row0..)."""

    def propose(self, x: DraftInputs, k: int) -> Proposal:
        """k tokens per row after the current token."""


class ModelDrafter:
    """A smaller model with the target's vocabulary, over static KV buffers (an Engine): its own, or the target's
    (a fused draft of the target's own layers, `quant:` or `layers:`, on ONNX Runtime's CPU provider: link_kv).

    Its cache mirrors the target's positions. Over its own cache, each step its draft graph re-reads the last two
    committed tokens (positions past_len-1, past_len): that fills the one position it may not have seen
    (the last accepted draft when all k were accepted) and rewrites the other with its own keys and values
    (identical, unless that position was copied from the target's cache: link_kv). Over the target's, it feeds
    the current token alone: every position before it is the target's.
    """

    def __init__(self, engine, name: str, min_margin: float = 0.0, report_margins: bool = False):
        self.engine = engine
        self.name = name
        self.min_margin = min_margin  # the margin stop, in logits (propose); 0: off
        self.report_margins = report_margins  # Proposal.margin even with the stop off (bench/replay.py's record)
        self.kv_source = None  # the target engine, where its KV can stand for this draft's (see link_kv)

    @property
    def shares_kv(self) -> bool:
        """The draft reads and writes the target's caches: it never lags (see link_kv)."""
        return getattr(self.engine, "kv_shared", False)

    def link_kv(self, target) -> bool:
        """A draft made of the target's own layers, a quantized copy (`quant:...`) or the target with fewer
        layers (`layers:...`), can read the target's keys and values of committed tokens in place of its own.
        For a quantized copy they are what its own would be, up to the quantization error. For a `layers:` draft
        they are its own exactly (in exact arithmetic) in the layers before its first skipped one, and the
        target's view of the text in the later ones, which its layers read in place of the keys and values
        their skip-shifted inputs would give. Where both engines keep their caches in host buffers of one layout:
        - a fused draft (OrtEngine.share_kv) reads and writes the target's caches (a layers: draft those of its
          kept layers) and keeps none of its own: the cache of a row is always the target's up to the current
          token, so the draft has no prompt to prefill and no catch-up after target-only steps, and its memory
          is its weights only (SmolLM2 int8: 0.28x the fp32 target's weights; its own cache at max_seq_len 1024
          was another 0.085x per row). It writes from the current position on, which the target's verify
          overwrites before it reads;
        - otherwise a quantized copy (portable graphs, whose draft rewrites the position before the current
          one) has its prompt and its catch-up copied from the target's cache (about 46 KB per token on
          SmolLM2), and a layers: draft keeps and fills its own.
        Lossless: a copy only changes what the draft proposes; over the target's caches, the draft never writes a
        committed position (its writes start at the current one, and the verify rewrites those). On SmolLM2 with an
        int8 draft a prefill chunk of the draft cost as much as the fp32 target's (40 ms at batch 1) and delayed
        the first token by a third."""
        mirrors = getattr(self.engine, "mirrors", None)
        own_layers = self.name.startswith((QUANT_PREFIX, LAYERS_PREFIX))
        source = target if own_layers and mirrors is not None and mirrors(target) else None
        shares = source is not None and self.engine.share_kv(target)
        if self.shares_kv and not shares:  # (before any state changes: it stays linked to the target it runs over)
            raise SpecExportError(f"the {self.name} draft already runs over another target's cache: open the engine "
                                  "again to pair it with this target")
        if self.name.startswith(LAYERS_PREFIX) and not shares:
            source = None  # (its cache is its own: its later layers' keys and values are not the target's)
        self.kv_source = source
        return source is not None

    def seed(self, rows: list[int], starts: list[int], ends: list[int]) -> None:
        """Positions starts[i]..ends[i]-1 of cache row rows[i]: the target's keys and values (link_kv; nothing to
        do where the caches are the target's own)."""
        if self.shares_kv:
            return
        for b, start, end in zip(rows, starts, ends):
            if end > start:
                self.engine.copy_kv(self.kv_source, b, start, end)

    def prefill(self, tokens, past_len, kv_len, row0=0):
        _no_committed_writes(self)
        self.engine.prefill(tokens, past_len, np.zeros_like(past_len), kv_len, row0)

    def rewrite(self, pairs: np.ndarray, past_len: np.ndarray, cache_len: int) -> None:
        """pairs [B, 2]: committed tokens at positions past_len-1, past_len, written into the KV cache by one
        greedy draft call whose drafts are discarded (a short catch-up; what it writes beyond past_len is
        overwritten before anything reads it). A fused engine chains one-token passes and an eager one takes any
        k, so they draft 1; a graph per k drafts the smallest built k."""
        _no_committed_writes(self)
        e = self.engine
        k = 1 if e.ks is None or not e.fixed_shapes or getattr(e, "fused", False) else min(e.ks)
        self.engine.draft(pairs, past_len, min(int(past_len.max()) + k + 1, cache_len), k, None, None)

    def propose(self, x: DraftInputs, k: int, done: list[bool] | None = None, take_over=None) -> Proposal:
        """k tokens per row, or fewer where the draft is a chain of one-pass calls (a `fused` engine), which a row
        leaves early:
        - after a near-tie (the margin stop): a draft token whose top logit leads the runner-up by less than
          `min_margin` is the row's last. A quantized copy agrees with the target wherever it is clear (SmolLM2's
          int8 copy: every draft with a margin over 0.75 was accepted), and its rejections sit at near-ties (about
          half of the drafts under 0.1 were), so the passes after one are mostly wasted;
        - where take_over(b, its drafts so far [i]) says so (HybridDrafter's handover: the caller fills the rest).
        done [B]: rows whose proposal comes from elsewhere (they end at once). The chain ends when every row has.
        Lossless: whether a row goes on depends only on the draft's own tokens and logits so far.
        The Proposal's `margin` [B, passes - 1] holds the margins the chain saw (None: the engine gives none, or
        nothing asked for them: the chain then runs its k passes without a callback)."""
        B = x.last_two.shape[0]
        end = np.full(B, k, dtype=np.int64)  # each row's proposal length
        live = [not d for d in done] if done is not None else [True] * B
        seen: list[np.ndarray | None] = [None]
        ties = [0, 0]  # near-ties, positions checked
        tied = np.zeros(B, dtype=bool)

        def until(drafts: np.ndarray, margin: np.ndarray | None) -> bool:  # drafts, margin [B, i]
            i, seen[0] = drafts.shape[1], margin
            check = margin is not None and self.min_margin > 0  # (the stop is on and the engine gives margins)
            for b in range(B):
                if not live[b]:
                    continue
                tie = check and near_tie(float(margin[b, i - 1]), self.min_margin)
                ties[0] += tie
                ties[1] += check
                tied[b] = tie
                if tie or take_over is not None and take_over(b, drafts[b]):
                    live[b], end[b] = False, i
            return not any(live)

        chain = getattr(self.engine, "fused", False) and k > 1 and (
            self.min_margin > 0 or take_over is not None or self.report_margins)
        if chain:
            draft, q = self.engine.draft(x.last_two, x.past_len, x.kv_len, k, x.sampling, x.u_draft, until)
        else:
            draft, q = self.engine.draft(x.last_two, x.past_len, x.kv_len, k, x.sampling, x.u_draft)
        i = draft.shape[1]
        if i < k:  # the chain ended early: padding, never accepted
            draft = np.concatenate([draft, np.zeros((B, k - i), dtype=draft.dtype)], 1)
            q = None if q is None else np.concatenate([q, np.zeros((B, k - i, q.shape[2]), q.dtype)], 1)
        draft_len = np.minimum(end, i)
        for b in np.flatnonzero(draft_len < i):  # rows that ended before the chain did: padding after their end
            draft[b, draft_len[b]:] = 0
            if q is not None:
                q[b, draft_len[b]:] = 0.0
        return Proposal(draft, q, draft_len, int(draft_len.max()), model_ran=True, passes=i, margin=seen[0],
                        ties=(ties[0], ties[1]), tied=tied)


def near_tie(margin: float, min_margin: float) -> bool:
    """The margin stop's rule (ModelDrafter.propose; bench/replay.py replays it): a draft whose top logit leads the
    runner-up by less than min_margin (> 0) is its row's last."""
    return min_margin > 0 and margin < min_margin


def _no_committed_writes(d: ModelDrafter) -> None:
    """A draft over the target's caches must never write a committed position (the target's tokens would change)."""
    if d.shares_kv:
        raise RuntimeError(f"the {d.name} draft runs over the target's cache: it has nothing to prefill or catch up")


class PromptLookupDrafter:
    """N-gram drafts: find an earlier occurrence of the last n tokens (n from ngram_max down to ngram_min)
    in the prompt and generated text, and propose up to k tokens that followed it. One-hot q.

    Which occurrence: the one whose preceding tokens match the text before the suffix furthest back (up to
    `context_max` tokens in all), then the latest with k tokens after it, else the earliest (which has the most).
    Text that copies a passage matches it far back, while a short n-gram also recurs elsewhere; the longest match
    is where the copy comes from. (Replayed over stop 35's traces, 48 prompts x 6 seeds of 10% cost noise: against
    the latest 3-gram occurrence, fixed k = 8 +2.7% on the bench prompts and +0.4% on the others, the hybrid at
    auto +3.5% and +0.1%, code_edit most; README, "Hybrid drafting", gives the real runs.) The matched length
    reported as the proposal's source (autok keeps acceptance per source) stays the n-gram's, at most ngram_max."""

    def __init__(self, ngram_min: int = 1, ngram_max: int = 3, context_max: int = 16):
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.context_max = max(context_max, ngram_max)
        self.name = PROMPT_LOOKUP

    def prefill(self, tokens, past_len, kv_len, row0=0):
        pass

    def lookup(self, seq: np.ndarray, k: int) -> tuple[np.ndarray, int]:
        """seq: [L] committed tokens -> (up to k proposed tokens, the matched n-gram length n; 0: none).
        One pass finds the earlier occurrences of the last token; each longer suffix filters those."""
        L = len(seq)
        if L < 2:
            return seq[:0], 0
        ends = np.flatnonzero(seq[:-1] == seq[-1])  # [m] end positions of 1-gram matches (the suffix excluded)
        found, n = None, 0
        for m in range(1, min(self.context_max, L - 1) + 1):
            if m > 1:  # keep the ends whose match extends one token further back
                ends = ends[ends >= m - 1]
                ends = ends[seq[ends - (m - 1)] == seq[L - m]]
            if not len(ends):
                break
            if m >= self.ngram_min:
                found, n = ends, min(m, self.ngram_max)
            if len(ends) == 1 and m >= self.ngram_max:  # one occurrence left: the choice is made
                break
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
        return Proposal(draft, None, draft_len, int(draft_len.max()), source)


def hand_over(lookup: PromptLookupDrafter, min_match: int, seq: np.ndarray, left: int) -> tuple[np.ndarray, int] | None:
    """The hybrid's handover rule. seq: a row's committed tokens and the model's drafts so far -> lookup's proposal
    for the `left` tokens after them and its n-gram length, where it matched at least min_match tokens; else None
    (the model drafts on). bench/replay.py replays the same rule."""
    found, n = lookup.lookup(seq, left)
    return (found, n) if n >= min_match and len(found) else None


class HybridDrafter:
    """Prompt lookup where it matched at least `min_match` tokens (its proposals cost no pass), the draft model
    for the other rows; rows stay ragged within one verify. A step where every row matched runs no draft pass
    (the model's cache then lags and the batch catches it up before its next draft, unless it is the target's:
    ModelDrafter.link_kv). Sources (specexport/autok):
    lookup rows keep their n-gram length (>= min_match >= 1), model rows are source 0.

    Handover (`handover`, on by default): a draft over the target's cache keeps no state of its own, so its chain
    of passes can end at any pass. While the model drafts, each row's committed text plus its drafts so far is
    looked up after every pass; once that ends in a match of at least min_match tokens, and where the step's rule
    allows it (model_propose's `pays`: autok.AutoK.handover_pays), the rest of the row's k tokens are lookup's
    (one-hot q) and the row needs no more passes: the chain ends when every model row has
    handed over. Where text returns to a passage after an edit, the passes that would re-draft it are saved.
    Lossless: each position's q is the distribution its token was drawn from given the tokens before it (the
    model's, or one-hot where a deterministic rule of those tokens chose lookup's)."""

    def __init__(self, lookup: PromptLookupDrafter, model: ModelDrafter, min_match: int = 2, handover: bool = True):
        self.lookup, self.model, self.min_match = lookup, model, max(min_match, 1)
        self.handover = handover
        self.engine = model.engine
        self.name = f"{PROMPT_LOOKUP}+{model.name}"

    def prefill(self, tokens, past_len, kv_len, row0=0):
        self.model.prefill(tokens, past_len, kv_len, row0)

    @property
    def hands_over(self) -> bool:
        """Does the model's chain hand rows over to lookup (on, over the target's cache)? autok.AutoK.handover."""
        return self.handover and self.model.shares_kv

    @property
    def kv_source(self):
        return self.model.kv_source

    @property
    def shares_kv(self):
        return self.model.shares_kv

    def link_kv(self, target) -> bool:
        return self.model.link_kv(target)

    def seed(self, rows, starts, ends):
        self.model.seed(rows, starts, ends)

    def rewrite(self, pairs, past_len, cache_len):
        self.model.rewrite(pairs, past_len, cache_len)

    def lookups(self, x: DraftInputs, k: int) -> tuple[Proposal, list[bool]]:
        """Lookup for every row -> (its proposal, which rows take it)."""
        lk = self.lookup.propose(x, k)
        return lk, [s >= self.min_match for s in lk.source]

    def model_propose(self, x: DraftInputs, k: int, use: list[bool], pays=None) -> Proposal:
        """The model's drafts for the rows not in `use`, which hand over to lookup where they can (class
        docstring) and where pays(b, j, source, n) allows (autok.AutoK.handover_pays: lookup's n tokens after the
        model's j promise more than drafting on), and end where the model is unsure (ModelDrafter.propose)."""
        if not (self.hands_over and k > 1):
            return self.model.propose(x, k, use)
        B = len(use)
        hist = [x.history[b, :x.lengths[b]] for b in range(B)]
        split: list[tuple[int, int, np.ndarray] | None] = [None] * B

        def take_over(b: int, drafts: np.ndarray) -> bool:  # drafts [i]: row b's drafts so far
            rest = hand_over(self.lookup, self.min_match, np.concatenate([hist[b], drafts]), k - len(drafts))
            if rest is not None and pays is not None and not pays(b, len(drafts), rest[1], len(rest[0])):
                rest = None
            if rest is not None:
                split[b] = (len(drafts), rest[1], rest[0])
            return rest is not None

        m = self.model.propose(x, k, use, take_over)
        if not any(split):
            return m
        draft, q, draft_len = m.draft.copy(), m.q, m.draft_len.copy()
        q = None if q is None else q.copy()
        for b, sp in enumerate(split):
            if sp is not None:
                j, _, found = sp
                draft[b, j:] = 0
                draft[b, j:j + len(found)] = found
                draft_len[b] = j + len(found)
                if q is not None:
                    q[b, j:] = 0.0
                    q[b, np.arange(j, j + len(found)), found] = 1.0
        return Proposal(draft, q, draft_len, int(draft_len.max()), model_ran=True, passes=m.passes,
                        handover=[None if sp is None else sp[:2] for sp in split], margin=m.margin, ties=m.ties,
                        tied=m.tied)

    def merge(self, lk: Proposal, use: list[bool], m: Proposal, sampling) -> Proposal:
        """Rows in `use` take lookup's proposal (one-hot q when sampling), the others the model's (source 0)."""
        take = np.array(use)
        draft = np.where(take[:, None], lk.draft, m.draft)  # [B, k]
        draft_len = np.where(take, lk.draft_len, m.draft_len)  # [B]
        q = m.q
        if q is not None and take.any():
            q = q.copy()
            for b in np.flatnonzero(take):
                q[b] = 0.0
                q[b, np.arange(q.shape[1]), draft[b]] = 1.0  # (padding past draft_len is never accepted)
        source = [s if t else 0 for s, t in zip(lk.source, use)]
        handover = None if m.handover is None else [None if t else h for t, h in zip(use, m.handover)]
        tied = None if m.tied is None else m.tied & ~take
        return Proposal(draft, q, draft_len, int(draft_len.max()), source, model_ran=True, passes=m.passes,
                        handover=handover, margin=m.margin, ties=m.ties, tied=tied)

    def propose(self, x: DraftInputs, k: int) -> Proposal:
        lk, use = self.lookups(x, k)
        if all(use):
            return Proposal(lk.draft, None, lk.draft_len, lk.longest, lk.source)
        return self.merge(lk, use, self.model_propose(x, k, use), x.sampling)
