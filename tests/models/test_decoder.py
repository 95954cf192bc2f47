"""Static-KV decoders against transformers' logits, fp32, within 1e-4."""

import json

import pytest
import torch

from helpers import FAMILIES, make_tiny
from specexport import SpecExportError
from specexport.models import KVCache, load_model


@pytest.mark.parametrize("family", FAMILIES + ("llama-tied",))
def test_logits_match_transformers_ragged_batch_with_garbage(tiny, family, tmp_path):
    if family == "llama-tied":
        hf, path = make_tiny(tmp_path / "m", "llama", tie_word_embeddings=True), tmp_path / "m"
    else:
        hf, path = tiny[family]["hf"], tiny[family]["target"]
    lm = load_model(path, max_positions=512)
    assert lm.config.tie_word_embeddings == (family == "llama-tied")
    torch.manual_seed(0)
    seqs = [torch.randint(0, 96, (n,)) for n in (40, 23, 31)]  # rows end at different lengths
    refs = [hf(s[None]).logits[0].detach() for s in seqs]
    cache = KVCache.allocate(lm.config, 3, 64, torch.float32)
    for t in cache.keys + cache.values:
        t.normal_(0, 10)  # garbage everywhere, incl. beyond each row's valid length
    # Prefill each row's first part at once (padding writes garbage past the shorter rows' ends) ...
    first = [12, 5, 9]
    chunk = torch.zeros(3, 16, dtype=torch.long)
    for b, s in enumerate(seqs):
        chunk[b, :first[b]] = s[:first[b]]
    with torch.no_grad():
        out = lm.model(chunk, torch.zeros(3, dtype=torch.long), cache, 16)
    for b in range(3):
        torch.testing.assert_close(out[b, :first[b]], refs[b][:first[b]], atol=1e-4, rtol=0)
    # ... then step every row from its own past_len, 3 tokens at a time, until all are done.
    pos = list(first)
    while any(p < len(s) for p, s in zip(pos, seqs)):
        toks = torch.stack([torch.nn.functional.pad(s[p:p + 3], (0, max(0, 3 - len(s[p:p + 3])))) for p, s in
                            zip(pos, seqs)])
        with torch.no_grad():
            out = lm.model(toks, torch.tensor(pos), cache, max(pos) + 3)
        for b, s in enumerate(seqs):
            n = min(3, len(s) - pos[b])
            if n > 0:
                torch.testing.assert_close(out[b, :n], refs[b][pos[b]:pos[b] + n], atol=1e-4, rtol=0)
        pos = [min(p + 3, len(s)) for p, s in zip(pos, seqs)]


def test_untied_llama_and_logits_index(tmp_path):
    hf = make_tiny(tmp_path / "m", "llama", tie_word_embeddings=False, rope_scaling=None, attention_bias=True)
    lm = load_model(tmp_path / "m")
    assert not lm.config.tie_word_embeddings and lm.config.o_bias and lm.config.rope_scaling is None
    x = torch.randint(0, 96, (2, 10))
    ref = hf(x).logits.detach()
    cache = KVCache.allocate(lm.config, 2, 16, torch.float32)
    with torch.no_grad():
        last = lm.model(x, torch.zeros(2, dtype=torch.long), cache, 10, torch.tensor([9, 4]))
    torch.testing.assert_close(last[:, 0], torch.stack([ref[0, 9], ref[1, 4]]), atol=1e-4, rtol=0)


def test_unsupported_model_type_lists_supported(tmp_path):
    make_tiny(tmp_path / "m", "llama")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecExportError, match="unsupported model type 'gpt2'.*llama, mistral, qwen2, qwen3"):
        load_model(tmp_path / "m")


def test_missing_path_and_pickles_refused(tmp_path):
    with pytest.raises(SpecExportError, match="does not exist"):
        load_model(tmp_path / "nope")
    make_tiny(tmp_path / "m", "qwen2")
    for f in (tmp_path / "m").glob("*.safetensors"):
        f.rename(f.with_suffix(".bin"))
    with pytest.raises(SpecExportError, match="pickled weights"):
        load_model(tmp_path / "m")


def test_gguf_loader_matches_transformers_gguf(smollm2_path):
    """Our GGUF reader (dequantize + llama.cpp q/k un-permute) gives transformers' own GGUF logits."""
    pytest.importorskip("accelerate", reason="transformers' GGUF loader needs accelerate ([dev] extra)")
    from pathlib import Path

    from transformers import AutoModelForCausalLM
    lm = load_model(smollm2_path)
    assert lm.config.model_type == "llama" and lm.config.tie_word_embeddings and lm.config.eos_token_ids == (2,)
    p = Path(smollm2_path)
    hf = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
    ids = lm.tokenizer("The capital of France is", return_tensors="pt").input_ids
    cache = KVCache.allocate(lm.config, 1, 32, torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(lm.model(ids, torch.zeros(1, dtype=torch.long), cache, ids.shape[1]),
                                   hf(ids).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])
def test_exported_draft_passes_match_the_in_place_ones(tiny, family):
    """The exported draft graph reads the caches and writes once at the end (run_pending); eagerly it writes
    every pass in place. Same drafts, same cache contents (mistral: with its sliding window in play)."""
    from specexport.models import load_model
    from specexport.steps import make_step
    m = load_model(tiny[family]["target"], "fp32", 64).model
    cfg, B, S, k = m.cfg, 2, 64, 3
    torch.manual_seed(0)
    kv = [torch.randn(B, cfg.num_kv_heads, S, cfg.head_dim) for _ in range(2 * cfg.num_layers)]
    past, L = torch.tensor([30, 9]), 40
    last_two = torch.tensor([[5, 7], [11, 3]])
    with torch.no_grad():
        a = make_step(m, "draft", k, False, cfg.vocab_size, inplace=True, static=True)(
            last_two, past, torch.arange(L), *[t.clone() for t in kv])
        b = make_step(m, "draft", k, False, cfg.vocab_size, inplace=False, static=True)(
            last_two, past, torch.arange(L), *[t.clone() for t in kv])
    assert torch.equal(a[0], b[0])
    for x, y in zip(a[1:], b[1:]):
        for r in range(B):
            torch.testing.assert_close(x[r, :, :past[r] + k], y[r, :, :past[r] + k], rtol=1e-5, atol=1e-5)
