"""SmolLM2-135M-Instruct (the default model): speculative greedy == target-only == transformers greedy."""

import pytest
import torch

from specexport import SpeculativeDecoder

PROMPTS = [
    "Rewrite this function with a list comprehension and return the full code:\n\n"
    "def squares(xs):\n    out = []\n    for x in xs:\n        out.append(x * x)\n    return out\n",
    "What is the capital of France? Answer in one sentence.",
    "List the three colors in this sentence: the red fox jumped over the blue fence near the green tree.",
]
NEW = 40


@pytest.fixture(scope="module")
def dec():
    return SpeculativeDecoder.from_pretrained(k=4, max_seq_len=512, max_batch=4)  # defaults: SmolLM2 + prompt lookup


@pytest.fixture(scope="module")
def hf_outputs(dec):
    pytest.importorskip("accelerate", reason="transformers' GGUF loader needs accelerate ([dev] extra)")
    from pathlib import Path

    from transformers import AutoModelForCausalLM
    src = Path(dec.source)
    hf = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32).eval()
    outs = []
    for p in PROMPTS:
        ids = torch.tensor([dec.encode(p, chat=True)])
        with torch.inference_mode():
            g = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
        outs.append(g[0, ids.shape[1]:].tolist())
    return outs


def test_default_model_is_smollm2_with_prompt_lookup(dec):
    assert dec.source.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert dec.drafter.name == "prompt-lookup"
    assert dec.eos_token_ids == {2}


def test_greedy_speculative_equals_transformers(dec, hf_outputs):
    spec = dec.generate(PROMPTS, max_new_tokens=NEW, chat=True)
    base = dec.generate(PROMPTS, max_new_tokens=NEW, chat=True, speculative=False)
    assert [o.token_ids for o in spec] == [o.token_ids for o in base] == hf_outputs
    assert sum(o.stats.accepted for o in spec) > 0  # prompt lookup does accept tokens on these prompts
    assert spec[1].text and "Paris" in spec[1].text


def test_stream_text_equals_generate_text(dec):
    ref = dec.generate(PROMPTS[0], max_new_tokens=NEW, chat=True)[0]
    events = list(dec.stream(PROMPTS[0], max_new_tokens=NEW, chat=True))
    assert "".join(e.text for e in events) == ref.text
    assert sum((e.token_ids for e in events), []) == ref.token_ids
    assert events[-1].finished and events[-1].stats.new_tokens == len(ref.token_ids)
