"""Tiny random checkpoints built from transformers configs (no hub, no downloads)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, eos_token_id=None, bos_token_id=None,
              pad_token_id=None)
SHAPES = dict(max_seq_len=128, max_batch=4, prefill_chunk=16)  # the tiny engines' build shapes


def hf_config(family: str, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
    kw = {**COMMON, **overrides}
    if family == "llama":  # llama3 rope scaling and tied embeddings (SmolLM2 / Llama 3.2 style)
        kw.setdefault("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        kw.setdefault("tie_word_embeddings", True)
        return LlamaConfig(**kw)
    if family == "mistral":  # untied, with a sliding window short enough to matter in tests
        kw.setdefault("sliding_window", 24)
        return MistralConfig(**kw)
    if family == "qwen2":  # qkv bias
        return Qwen2Config(**kw)
    if family == "qwen3":  # q/k norms, explicit head_dim
        kw.setdefault("head_dim", 32)
        return Qwen3Config(**kw)
    raise ValueError(family)


def make_tiny(path: Path, family: str, seed: int = 0, logit_scale: float = 1.0, perturb_from=None,
              perturb: float = 0.0, tokenizer=None, **overrides):
    """Save a random tiny model to `path`. logit_scale sharpens its distributions; perturb_from copies
    another model's weights plus gaussian noise of std `perturb` (a partially agreeing draft)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family, **overrides)).eval()
    with torch.no_grad():
        if perturb_from is not None:
            model.load_state_dict(perturb_from.state_dict())
            for p in model.parameters():
                p.add_(torch.randn_like(p) * perturb)
        if logit_scale != 1.0:
            model.model.norm.weight.mul_(logit_scale)
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
        cfg_path = Path(path) / "tokenizer_config.json"  # keep AutoTokenizer from picking the family's class
        cfg = json.loads(cfg_path.read_text())
        cfg_path.write_text(json.dumps({**cfg, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return model


WORDS = [f"w{i}" for i in range(96)]  # the word tokenizer's vocabulary in the texty engines


def word_tokenizer(words: list[str]):
    """A small word-level fast tokenizer over `words` (ids in order)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=words[0])


def hf_greedy(hf, prompt: list[int], new: int) -> list[int]:
    """transformers generate(do_sample=False); the explicit mask stops it reading token 0 as padding."""
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def watch_draft_writes(dec) -> dict:
    """Wrap the draft: every engine call's first written position is at or after each row's current position, and
    the target's cache before it is bit for bit what it was before the draft ran."""
    eng, model = dec.drafter.engine, getattr(dec.drafter, "model", dec.drafter)
    propose, run, current, checked = model.propose, eng._run, [], {"calls": 0}

    def watched_propose(x, k, *a):
        B, n = len(x.past_len), int(x.past_len.max())
        before = [a[:B, :, :n].copy() for a in dec.target._kv_np]
        current.append(x.past_len.copy())
        out = propose(x, k, *a)
        for a, b in zip(dec.target._kv_np, before):
            for row, p in enumerate(x.past_len.tolist()):
                assert np.array_equal(a[row, :, :p], b[row, :, :p]), "the draft wrote a committed position"
        return out

    def watched_run(name, B, ins, *a, **kw):
        first = ins["past_len"] - ins["tokens"].shape[1] + 1  # [B] the first position the call writes
        assert (first >= current[-1][:B]).all(), (name, first, current[-1])
        checked["calls"] += 1
        return run(name, B, ins, *a, **kw)

    model.propose, eng._run = watched_propose, watched_run
    return checked


def load_tool(name: str):
    """A script of tools/ as a module (tools/ is not a package)."""
    path = Path(__file__).resolve().parents[1] / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
