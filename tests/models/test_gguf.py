"""GGUF loading for each family: a tiny model written with gguf's own writer (llama.cpp's tensor names and
q/k row order) loads to transformers' logits."""

import numpy as np
import pytest
import torch

from helpers import make_tiny
from specexport.models import KVCache, load_model


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:  # what llama.cpp's converter does to llama q/k rows
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf, path, arch: str, qtypes: dict | None = None) -> None:
    """qtypes: checkpoint-name suffix (e.g. "q_proj.weight") -> a gguf quantization type name for that tensor."""
    import gguf
    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_eos_token_id(7)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
                 "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
                 "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
                 "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
                 "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
                 "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
                 "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
    for name, t in hf.state_dict().items():
        a = t.detach().float().numpy().copy()
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            g = f"blk.{i}.{per_layer[rest]}"
            if arch == "llama" and rest == "self_attn.q_proj.weight":
                a = _permute(a, c.num_attention_heads)
            if arch == "llama" and rest == "self_attn.k_proj.weight":
                a = _permute(a, c.num_key_value_heads)
        else:
            g = names[name]
        qtype = next((q for suffix, q in (qtypes or {}).items() if name.endswith(suffix)), None)
        if qtype is None:
            w.add_tensor(g, a)
        else:
            t = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(g, gguf.quants.quantize(a, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_gguf_matches_transformers(tmp_path, family):
    hf = make_tiny(tmp_path / "hf", family, seed=5, tie_word_embeddings=False, rope_scaling=None)
    write_gguf(hf, tmp_path / "m.gguf", family)
    lm = load_model(tmp_path / "m.gguf")
    assert lm.config.model_type == family and lm.config.eos_token_ids == (7,) and lm.tokenizer is None
    assert lm.config.qkv_bias == (family == "qwen2") and lm.config.qk_norm == (family == "qwen3")
    x = torch.randint(0, 96, (2, 12))
    cache = KVCache.allocate(lm.config, 2, 16, torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(lm.model(x, torch.zeros(2, dtype=torch.long), cache, 12), hf(x).logits,
                                   atol=1e-4, rtol=0)
