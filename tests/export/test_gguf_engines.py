"""Engines over GGUF weights as stored (Q4_1 / Q8_0 / Q5_0 / Q4_0 / Q5_1 codes in MatMulNBits, block minimums
as an added term): lossless against the engine's own target-only steps at every k and auto, on the fused and the
portable graph sets; with fp32 activations, transformers' greedy tokens over the dequantized GGUF; sampling keeps
the target's distribution."""

import numpy as np
import pytest
import torch

from helpers import hf_greedy, make_tiny
from models.test_gguf import write_gguf
from specexport import SamplingParams, SpeculativeDecoder
from specexport.config import BuildConfig
from specexport.export.build import build
from test_runtime_greedy import NEW, PROMPTS

SHAPES = dict(max_seq_len=128, max_batch=4, prefill_chunk=16)
QTYPES = {"q_proj.weight": "Q4_1", "k_proj.weight": "Q4_1", "v_proj.weight": "Q8_0", "o_proj.weight": "Q5_0",
          "gate_proj.weight": "Q4_0", "up_proj.weight": "Q5_1", "down_proj.weight": "Q4_1", "lm_head.weight": "Q8_0"}


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    """A tiny llama written as a mixed-format GGUF, and transformers' model over its dequantized weights."""
    import gguf
    from gguf.quants import dequantize, quantize
    root = tmp_path_factory.mktemp("gguf")
    hf = make_tiny(root / "hf", "llama", seed=3, logit_scale=4.0, tie_word_embeddings=False, rope_scaling=None)
    write_gguf(hf, root / "m.gguf", "llama", QTYPES)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            q = next((t for s, t in QTYPES.items() if name.endswith(s)), None)
            if q is not None:
                t = gguf.GGMLQuantizationType[q]
                a = p.detach().numpy().copy()
                p.copy_(torch.from_numpy(dequantize(quantize(a, t), t).reshape(a.shape).astype(np.float32)))
    return dict(path=str(root / "m.gguf"), hf=hf, root=root)


@pytest.fixture(scope="module")
def gguf_engines(gguf_model):
    out = {}
    for name, kw in (("int8", {}), ("portable", dict(ops="portable")), ("fp32", dict(activations="fp32")),
                     ("copy", dict(draft="quant:int8"))):  # a smoothed copy made from the codes as stored
        cfg = BuildConfig(target=gguf_model["path"], ks=(1, 3), out=str(gguf_model["root"] / name), **SHAPES, **kw)
        out[name] = build(cfg, progress=False)["out"]
    return out


@pytest.mark.parametrize("name", ["int8", "portable", "fp32", "copy"])
def test_speculative_equals_target_only(gguf_engines, name):
    dec = SpeculativeDecoder.load(gguf_engines[name])
    want = [o.token_ids for o in dec.generate(PROMPTS, NEW, speculative=False)]
    for k in (1, 3, "auto"):
        assert [o.token_ids for o in dec.generate(PROMPTS, NEW, k=k)] == want, f"k={k}"
    for p, w in zip(PROMPTS, want):  # batch 1 (the fused graphs' own multi-token path) gives the same
        assert dec.generate([p], NEW, k=3)[0].token_ids == w


def test_fp32_activations_equal_transformers_on_the_dequantized_gguf(gguf_engines, gguf_model):
    dec = SpeculativeDecoder.load(gguf_engines["fp32"])
    want = [hf_greedy(gguf_model["hf"], p, NEW) for p in PROMPTS]
    assert [o.token_ids for o in dec.generate(PROMPTS, NEW, k=3)] == want
    eager = SpeculativeDecoder.load(gguf_engines["fp32"], backend="torch")  # codes rebuilt from the engine file
    assert [o.token_ids for o in eager.generate(PROMPTS, NEW, k=3)] == want


def test_manifest_records_the_stored_layers(gguf_engines):
    import json
    from pathlib import Path
    m = json.loads((Path(gguf_engines["int8"]) / "manifest.json").read_text())
    layers = m["models"]["target"]["quant_layers"]
    assert layers["lm_head"]["bits"] == 8 and layers["lm_head"]["symmetric"]  # Q8_0
    assert "pooled" not in layers["lm_head"]  # recorded only where set (older runtimes read such records)
    assert layers["model.layers.0.self_attn.qkv_proj"]["mins"]  # Q4_1 q/k joined with Q8_0 v: 8-bit, with minimums
    assert layers["model.layers.0.mlp.down_proj"] == {**layers["model.layers.0.mlp.down_proj"], "bits": 4, "mins": True,
                                                       "pooled": True}


def test_same_seed_same_tokens(gguf_engines):
    dec = SpeculativeDecoder.load(gguf_engines["int8"])
    sp = [SamplingParams(0.9, top_k=20, seed=5), SamplingParams(), SamplingParams(1.2, seed=6)]
    a = [o.token_ids for o in dec.generate(PROMPTS, NEW, sampling=sp, k=3)]
    assert a == [o.token_ids for o in dec.generate(PROMPTS, NEW, sampling=sp, k=3)]
