"""Bad input gets one clear error naming the problem and the fix; never silently wrong tokens."""

import pytest

from helpers import make_tiny, word_tokenizer
from specexport import SamplingParams, SpecExportError, SpeculativeDecoder


@pytest.fixture(scope="module")
def dec(tiny):
    t = tiny["qwen2"]
    return SpeculativeDecoder.from_pretrained(t["target"], "prompt-lookup", k=2, max_seq_len=32, max_batch=2)


def test_missing_paths(tiny, tmp_path):
    with pytest.raises(SpecExportError, match="target path .* does not exist"):
        SpeculativeDecoder.from_pretrained(str(tmp_path / "nope"))
    with pytest.raises(SpecExportError, match="draft path .* does not exist"):
        SpeculativeDecoder.from_pretrained(tiny["llama"]["target"], str(tmp_path / "nope"))


def test_unsupported_architecture(tiny, tmp_path):
    import json
    make_tiny(tmp_path / "m", "llama")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "model_type": "falcon"}))
    with pytest.raises(SpecExportError, match="unsupported model type 'falcon'.*llama, mistral, qwen2, qwen3"):
        SpeculativeDecoder.from_pretrained(tiny["llama"]["target"], str(tmp_path / "m"))


def test_k_below_one_and_unknown_options(tiny):
    with pytest.raises(SpecExportError, match="k must be >= 1"):
        SpeculativeDecoder.from_pretrained(tiny["llama"]["target"], k=0)
    with pytest.raises(SpecExportError, match="unknown option"):
        SpeculativeDecoder.from_pretrained(tiny["llama"]["target"], kk=3)
    with pytest.raises(SpecExportError, match="backend 'tensorrt' is not available"):
        SpeculativeDecoder.from_pretrained(tiny["llama"]["target"], backend="tensorrt")


def test_request_errors(dec):
    with pytest.raises(SpecExportError, match="prompt 0 is empty"):
        dec.generate([[]])
    with pytest.raises(SpecExportError, match="prompt 0 has 10 tokens and max_new_tokens=30.*> max_seq_len=32"):
        dec.generate([1] * 10, max_new_tokens=30)
    with pytest.raises(SpecExportError, match="3 prompts exceed max_batch=2"):
        dec.generate([[1], [2], [3]])
    with pytest.raises(SpecExportError, match="max_new_tokens must be >= 1"):
        dec.generate([1, 2], max_new_tokens=0)
    with pytest.raises(SpecExportError, match="outside the vocabulary"):
        dec.generate([1, 96])
    with pytest.raises(SpecExportError, match="no tokenizer"):
        dec.generate("text needs a tokenizer")
    with pytest.raises(SpecExportError, match="k must be between 1 and 2"):
        dec.generate([1, 2], k=3, max_new_tokens=4)
    # the decoder still works after every rejected request
    assert len(dec.generate([1, 2, 3], max_new_tokens=4)[0].token_ids) == 4


@pytest.mark.parametrize("kw,msg", [(dict(temperature=-1), "temperature must be >= 0"),
                                    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
                                    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
                                    (dict(top_k=-2), "top_k must be >= 0")])
def test_bad_sampling_params(kw, msg):
    with pytest.raises(SpecExportError, match=msg):
        SamplingParams(**kw)


WORDS = [f"w{i}" for i in range(90)]


def test_vocabulary_checks(tmp_path):
    tok = word_tokenizer(WORDS)
    make_tiny(tmp_path / "t", "llama", seed=1, tokenizer=tok, vocab_size=96)
    # a different tokenizer: genuinely different vocabulary
    make_tiny(tmp_path / "other", "llama", seed=2, tokenizer=word_tokenizer(WORDS[::-1]), vocab_size=96)
    with pytest.raises(SpecExportError, match="draft vocabulary differs from the target's"):
        SpeculativeDecoder.from_pretrained(str(tmp_path / "t"), str(tmp_path / "other"))
    # no tokenizers and different sizes: nothing shows the tail is padding
    make_tiny(tmp_path / "a", "qwen2", seed=1, vocab_size=96)
    make_tiny(tmp_path / "b", "qwen2", seed=2, vocab_size=100)
    with pytest.raises(SpecExportError, match="vocabulary size 100 differs from the target's 96"):
        SpeculativeDecoder.from_pretrained(str(tmp_path / "a"), str(tmp_path / "b"))
    # the same tokenizer, embedding too small for it
    make_tiny(tmp_path / "small", "llama", seed=3, tokenizer=tok, vocab_size=80)
    with pytest.raises(SpecExportError, match="cannot both hold the 90-token vocabulary"):
        SpeculativeDecoder.from_pretrained(str(tmp_path / "t"), str(tmp_path / "small"))


@pytest.mark.parametrize("draft_vocab", [92, 128])
def test_padded_vocabulary_tails_are_masked(tmp_path, draft_vocab):
    """Same tokenizer, padded embeddings of different sizes (like 151936 vs 152064): works, exactly."""
    tok = word_tokenizer(WORDS)
    make_tiny(tmp_path / "t", "qwen2", seed=1, tokenizer=tok, vocab_size=96, logit_scale=4.0)
    make_tiny(tmp_path / "d", "qwen2", seed=2, tokenizer=tok, vocab_size=draft_vocab, logit_scale=4.0)
    dec = SpeculativeDecoder.from_pretrained(str(tmp_path / "t"), str(tmp_path / "d"), k=3, max_seq_len=64)
    prompt = "w1 w2 w3 w4 w5 w6"
    spec = dec.generate(prompt, max_new_tokens=20)[0]
    assert spec.token_ids == dec.generate(prompt, max_new_tokens=20, speculative=False)[0].token_ids
    assert spec.text and spec.stats.drafted > 0
    sampled = dec.generate(prompt, max_new_tokens=20, sampling=SamplingParams(1.0, seed=1))[0].token_ids
    assert all(t < 96 for t in sampled)
