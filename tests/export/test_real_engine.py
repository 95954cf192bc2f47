"""SmolLM2-135M-Instruct built into ONNX engines: the dequantized fp32 engine gives transformers' greedy tokens on
ONNX Runtime and torch; the default engine (the GGUF's Q4_1 / Q8_0 codes as stored, int8 activations) gives
its own target-only tokens at every k and auto."""

import pytest

from specexport import SpeculativeDecoder
from specexport.config import BuildConfig
from specexport.export.build import build
from test_real_model import NEW, PROMPTS, dec, hf_outputs  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def smol_engine(tmp_path_factory):
    out = tmp_path_factory.mktemp("smol") / "eng"
    build(BuildConfig(ks=(4,), max_seq_len=256, max_batch=3, sampling=False, dtype="fp32", out=str(out)),
          progress=False)
    return str(out)


@pytest.fixture(scope="module")
def smol_gguf_engine(tmp_path_factory):
    out = tmp_path_factory.mktemp("smol") / "gguf"
    build(BuildConfig(ks=(2, 4), max_seq_len=256, max_batch=1, sampling=False, out=str(out)), progress=False)
    return str(out)


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_smollm2_engine_equals_transformers(smol_engine, hf_outputs, backend):  # noqa: F811
    eng = SpeculativeDecoder.load(smol_engine, backend=backend)
    spec = eng.generate(PROMPTS, max_new_tokens=NEW, chat=True)
    base = eng.generate(PROMPTS, max_new_tokens=NEW, chat=True, speculative=False)
    assert [o.token_ids for o in spec] == [o.token_ids for o in base] == hf_outputs
    assert sum(o.stats.accepted for o in spec) > 0
    assert "Paris" in spec[1].text
    one = eng.generate(PROMPTS[0], max_new_tokens=NEW, chat=True)[0]  # batch 1: its own bindings
    assert one.token_ids == hf_outputs[0]


def test_smollm2_gguf_as_stored_is_lossless(smol_gguf_engine):
    eng = SpeculativeDecoder.load(smol_gguf_engine)
    for p in PROMPTS:
        want = eng.generate(p, max_new_tokens=NEW, chat=True, speculative=False)[0]
        for k in (2, 4, "auto"):
            assert eng.generate(p, max_new_tokens=NEW, chat=True, k=k)[0].token_ids == want.token_ids, k
    assert "Paris" in want.text or "Paris" in eng.generate(PROMPTS[1], max_new_tokens=NEW, chat=True)[0].text
