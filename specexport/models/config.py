"""ModelConfig: the architecture facts the static-KV decoder needs, read from HF config.json or GGUF."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import SpecExportError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "linear", ...}; None: plain RoPE
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # qwen2; llama/qwen3 with attention_bias
    o_bias: bool = False  # llama/qwen3 with attention_bias
    qk_norm: bool = False  # qwen3: RMSNorm over head_dim on q and k before RoPE
    mlp_bias: bool = False
    sliding_window: int | None = None  # mistral v0.1: each query sees the last `sliding_window` keys
    max_position_embeddings: int = 2048
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    bos_token_id: int | None = None

    @classmethod
    def from_manifest(cls, c: dict) -> "ModelConfig":
        """The config an engine manifest recorded (JSON lists back to tuples)."""
        return cls(**{**c, "eos_token_ids": tuple(c["eos_token_ids"])})

    @classmethod
    def from_hf(cls, d: dict, generation_config: dict | None = None) -> "ModelConfig":
        """From a transformers config.json dict (transformers 4.x and 5.x spellings)."""
        mt = d.get("model_type")
        check_model_type(mt)
        heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or d.get("rope_theta") or 10000.0
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
        attn_bias = bool(d.get("attention_bias", False))
        window = d.get("sliding_window")
        if mt in ("qwen2", "qwen3") and not d.get("use_sliding_window", False):
            window = None  # qwen configs carry a sliding_window that is off unless use_sliding_window
        eos = _ids(d.get("eos_token_id")) + _ids((generation_config or {}).get("eos_token_id"))
        return cls(
            model_type=mt,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=(mt == "qwen2") or attn_bias,
            o_bias=attn_bias and mt != "qwen2",
            qk_norm=(mt == "qwen3"),
            mlp_bias=bool(d.get("mlp_bias", False)),
            sliding_window=window,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            eos_token_ids=tuple(dict.fromkeys(eos)),
            bos_token_id=d.get("bos_token_id"),
        )


def check_model_type(model_type) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise SpecExportError(
            f"unsupported model type {model_type!r}: specexport supports {', '.join(SUPPORTED_MODEL_TYPES)}")


def _ids(v) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in v] if isinstance(v, (list, tuple)) else [int(v)]
