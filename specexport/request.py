"""What a generation request carries through the runtime: its ids, sampling and stop rules (`Request`), the
tokens it has committed, and what it reports (`GenerationStats`, `GenerationOutput`, `StreamEvent`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

from .config import SamplingParams
from .detokenize import REPLACEMENT, IncrementalText


@dataclass
class GenerationStats:
    k: int | str = 0  # the k asked for ("auto": chosen per step, see k_steps)
    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0  # decode steps after prefill (each commits n_accepted + 1 tokens)
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0  # steps where a proposed draft token was rejected (acceptance MLE: accepted / (+ rejected))
    accept_hist: list[int] = field(default_factory=list)  # [k+1]: steps that accepted 0..k drafts
    proposed_hist: list[int] = field(default_factory=list)  # [k+1]: steps that proposed 0..k drafts
    k_steps: dict[int, int] = field(default_factory=dict)  # k used -> steps (0: target-only steps)
    drafted_by: dict[str, int] = field(default_factory=dict)  # drafter ("prompt-lookup" | "model" | "model+lookup":
    #                                                             the model handed its draft over to lookup) -> tokens
    accepted_by: dict[str, int] = field(default_factory=dict)  # drafter -> accepted tokens
    rejected_by: dict[str, int] = field(default_factory=dict)  # drafter -> steps with a rejection
    steps_by: dict[str, int] = field(default_factory=dict)  # drafter -> steps it proposed in
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    host_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_mle(self) -> float:
        """Leviathan's per-token acceptance probability a, estimated from this generation."""
        n = self.accepted + self.rejected
        return self.accepted / n if n else 0.0

    @property
    def accepted_per_pos(self) -> list[int]:
        """[k]: steps whose i-th draft token (i = 1..k) was accepted (vLLM's num_accepted_tokens_per_pos)."""
        return [sum(self.accept_hist[i:]) for i in range(1, len(self.accept_hist))]

    @property
    def drafted_per_pos(self) -> list[int]:
        """[k]: steps that proposed an i-th draft token (fewer at later positions for ragged drafts)."""
        return [sum(self.proposed_hist[i:]) for i in range(1, len(self.proposed_hist))]

    @property
    def acceptance_per_pos(self) -> list[float]:
        """[k]: the share of i-th draft tokens accepted (every earlier one accepted too)."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_pos, self.drafted_per_pos)]

    @property
    def mean_committed_per_step(self) -> float:
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def decode_s(self) -> float:
        return self.draft_s + self.verify_s + self.host_s

    @property
    def tokens_per_s(self) -> float:
        total = self.prefill_s + self.decode_s
        return self.new_tokens / total if total else 0.0

    @property
    def decode_rate(self) -> float:
        """Decode tokens per second: the tokens after the first (which prefill gives) over the decode time."""
        return (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(acceptance_rate=self.acceptance_rate, acceptance_mle=self.acceptance_mle,
                 mean_committed_per_step=self.mean_committed_per_step, tokens_per_s=self.tokens_per_s,
                 accepted_per_pos=self.accepted_per_pos, drafted_per_pos=self.drafted_per_pos,
                 acceptance_per_pos=self.acceptance_per_pos)
        return d


@dataclass
class GenerationOutput:
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" (EOS or a stop id) | "length"
    stats: GenerationStats


@dataclass
class StreamEvent:
    index: int  # which prompt of the batch
    token_ids: list[int]  # tokens committed by this step (prefill yields the first one)
    text: str  # the text those tokens add (held back while a UTF-8 character is incomplete)
    finished: bool
    finish_reason: str | None = None
    stats: GenerationStats | None = None  # on the final event


@dataclass
class Request:
    ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset[int]
    stop_strings: tuple[str, ...] = ()
    decode: Callable[[list[int]], str] | None = None  # the tokenizer's (needed for text and stop strings)
    out: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    text_end: int | None = None  # with a stop string: where it starts in the decoded output
    stats: GenerationStats = field(default_factory=GenerationStats)

    def __post_init__(self):
        self._text = IncrementalText(self.decode) if self.decode is not None else None

    def commit(self, tokens: list[int]) -> list[int]:
        """Append committed tokens up to a stop id, a stop string or max_new_tokens; returns what was taken."""
        before = len(self.out)
        taken = []
        for t in tokens:
            taken.append(t)
            self.out.append(t)
            if t in self.stop_ids:
                self.finish_reason = "stop"
                break
            if len(self.out) >= self.max_new_tokens:
                self.finish_reason = "length"
                break
        if self.stop_strings:  # (also when a stop id ended this commit: a stop string before it comes first)
            seen = len(self._text.text)  # a new match ends in the text these tokens add
            text = self._text.final(self.out)
            tail = text[max(0, seen - max(map(len, self.stop_strings)) + 1):]
            if any(s in tail for s in self.stop_strings):  # keep the tokens up to the one completing it
                for n in range(before + 1, len(self.out) + 1):
                    text = self.decode(self.out[:n])
                    hits = [text.find(s) for s in self.stop_strings if s in text]
                    if hits:
                        del self.out[n:]
                        taken = taken[:n - before]
                        self.finish_reason, self.text_end = "stop", min(hits)
                        self._text = IncrementalText(self.decode)  # (its offsets were past the cut)
                        break
        self.stats.new_tokens = len(self.out)
        return taken

    def visible_text(self) -> str | None:
        """The text a client may see so far (None without a tokenizer): cut at a stop string, and (while running)
        without a tail that could still become one, or an incomplete UTF-8 character. Decoded incrementally
        (detokenize.py): each call decodes only the tokens since the last."""
        if self._text is None:
            return None
        if self.finish_reason:
            text = self._text.final(self.out)
            return text if self.text_end is None else text[:self.text_end]
        text = self._text.update(self.out).rstrip(REPLACEMENT)
        hold = 0
        for s in self.stop_strings:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        return text[:len(text) - hold]
