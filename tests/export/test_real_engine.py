"""SmolLM2-135M-Instruct built into an ONNX engine: ONNX Runtime == torch == transformers greedy, token for token."""

import pytest

from specexport import SpeculativeDecoder
from specexport.config import BuildConfig
from specexport.export.build import build
from test_real_model import NEW, PROMPTS, dec, hf_outputs  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def smol_engine(tmp_path_factory):
    out = tmp_path_factory.mktemp("smol") / "eng"
    build(BuildConfig(ks=(4,), max_seq_len=256, max_batch=3, sampling=False, out=str(out)), progress=False)
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
