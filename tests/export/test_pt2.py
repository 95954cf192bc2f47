"""The pt2 format (torch.export + AOTInductor): greedy equals transformers for every family, the same seed gives
the same tokens as the other backends, sampling has the target's distribution, and a package built by another
torch is refused. AOTInductor compiles one C++ library per graph (about 10-20 s each here), so the engines are
small: prompt lookup, greedy only, one k (3 graphs per family); one sampling engine with a draft (8 graphs)."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import FAMILIES, hf_greedy, make_tiny
from specexport import SamplingParams, SpeculativeDecoder, SpecExportError
from specexport.config import BuildConfig
from specexport.export.build import build
from test_runtime_greedy import NEW, PROMPTS
from test_runtime_sampling import (CASES, ENGINE_SHAPES, N, chi2_pvalue, exact_distribution, sample,  # noqa: F401
                                   small)  # (small: a fixture)


@pytest.fixture(scope="module")
def lookup_engines(tiny, tmp_path_factory):
    """family -> (a prompt-lookup pt2 engine (greedy graphs, k=2), built on first use; its transformers model).
    llama: a tied-embedding model (SmolLM2 style: the graphs name the head, the weights file stores the embedding)."""
    root, built = tmp_path_factory.mktemp("pt2_lookup"), {}

    def get(family):
        if family not in built:
            target, hf = tiny[family]["target"], tiny[family]["hf"]
            if family == "llama":
                target = str(root / "tied")
                hf = make_tiny(target, "llama", seed=10, logit_scale=4.0, tie_word_embeddings=True)
            cfg = BuildConfig(target=target, ks=(2,), sampling=False, max_seq_len=112, max_batch=3,
                              prefill_chunk=16, formats=("pt2",), out=str(root / family))
            built[family] = build(cfg, progress=False), hf
        return built[family]
    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_pt2_greedy_equals_transformers(lookup_engines, family):
    info, hf = lookup_engines(family)
    assert "target/steps.pt2" in info["files"] and not any(f.endswith(".onnx") for f in info["files"])
    if family == "llama":
        assert hf.config.tie_word_embeddings
        pt2 = json.loads((Path(info["out"]) / "manifest.json").read_text())["models"]["target"]["pt2"]
        assert pt2["aliases"] == {"model.lm_head.weight": "model.model.embed_tokens.weight"}
    dec = SpeculativeDecoder.load(info["out"], backend="pt2")
    want = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    assert [o.token_ids for o in dec.generate(PROMPTS, NEW, speculative=False)] == want
    outs = dec.generate(PROMPTS, NEW, k=2)
    assert [o.token_ids for o in outs] == want
    assert sum(o.stats.accepted for o in outs) > 0  # prompt lookup found drafts (PROMPTS[1] repeats)
    assert [dec.generate([p], NEW)[0].token_ids for p in PROMPTS] == want  # batch 1: the same graphs (dynamic B)


@pytest.fixture(scope="module")
def sampling_engine(small, tmp_path_factory):  # noqa: F811
    """The sampling test's tiny qwen2 pair, one engine in every format: k=2, max_batch 100."""
    out = tmp_path_factory.mktemp("pt2_sampling") / "eng"
    info = build(BuildConfig(target=small["target"], draft=small["draft"], formats=("onnx", "torchscript", "pt2"),
                             out=str(out), **ENGINE_SHAPES), progress=False)
    return info["out"]


def test_pt2_manifest_and_weights_once(sampling_engine):
    m = json.loads((Path(sampling_engine) / "manifest.json").read_text())
    for role, n in (("target", 5), ("draft", 3)):
        pt2 = m["models"][role]["pt2"]
        assert pt2["file"] == f"{role}/steps.pt2" and pt2["torch"] == torch.__version__ and len(pt2["graphs"]) == n
        assert set(pt2["compile_s"]) == set(pt2["graphs"])
    import zipfile
    with zipfile.ZipFile(Path(sampling_engine) / "target/steps.pt2") as z:  # no weights inside the package
        names = z.namelist()
    assert not any("weights" in n or n.endswith(".bin") for n in names), names
    assert {n.split("/")[3] for n in names if "/aotinductor/" in n} == set(m["models"]["target"]["pt2"]["graphs"])


def test_pt2_graphs_share_one_copy_of_the_weights(sampling_engine):
    """Every graph's constants are the engine's tensors from weights.safetensors (user-managed, not copied):
    zeroing the head in that one dict zeroes the logits of prefill and the verify graphs alike."""
    eng = SpeculativeDecoder.load(sampling_engine, backend="pt2").target
    tokens, past, last = np.array([[1, 2, 3, 4, 5, 6, 7, 0]]), np.array([0]), np.array([6])
    assert np.abs(eng.prefill(tokens, past, last, 8)).sum() > 0
    eng.weights["model.lm_head.weight"].zero_()
    assert np.abs(eng.prefill(tokens, past, last, 8)).sum() == 0
    n_acc, nxt, _ = eng.verify(np.array([[3, 1, 2]]), np.array([2]), np.array([7]), 10, 2, None, None, None)
    assert n_acc.tolist() == [0] and nxt.tolist() == [0]  # argmax of all-zero logits; draft token 1 rejected


def test_pt2_writes_the_cache_rows_in_place(sampling_engine):
    """A request joining a running batch is prefilled in its own row (row0 > 0): a view of the caches."""
    a, b = (SpeculativeDecoder.load(sampling_engine, backend=x).target for x in ("torchscript", "pt2"))
    tokens, past, last = np.array([[1, 2, 3, 4, 5, 6, 7, 0]]), np.array([3]), np.array([6])
    la, lb = (e.prefill(tokens, past, last, 11, row0=2) for e in (a, b))
    np.testing.assert_allclose(la, lb, rtol=1e-5, atol=1e-5)
    S = a.cache.seq_len
    for x, y in zip(a.cache.keys + a.cache.values, b.cache.keys + b.cache.values):
        torch.testing.assert_close(x[:, :, :S], y[:, :, :S])
        assert y[2, :, 3:11].abs().sum() > 0 and y[:2].abs().sum() == 0 == y[3:].abs().sum()


def test_pt2_same_seed_same_tokens_as_the_other_backends(sampling_engine):
    decs = {b: SpeculativeDecoder.load(sampling_engine, backend=b, max_batch=3)
            for b in ("onnxruntime", "torch", "torchscript", "pt2")}
    prompts = [[1, 2, 3, 1, 2], [4, 5, 6, 7], [3, 3, 1]]
    sampling = [SamplingParams(0.9, top_k=5, top_p=0.9, seed=5), SamplingParams(), SamplingParams(1.2, seed=6)]
    for k, speculative in ((2, True), (2, False)):
        got = {b: [o.token_ids for o in d.generate(prompts, 8, sampling=sampling, k=k, speculative=speculative)]
               for b, d in decs.items()}
        assert got["pt2"] == got["onnxruntime"] == got["torch"] == got["torchscript"], (k, speculative)
    lookup = SpeculativeDecoder.load(sampling_engine, backend="pt2", drafter="prompt-lookup")  # one-hot q
    ref = SpeculativeDecoder.load(sampling_engine, backend="onnxruntime", drafter="prompt-lookup")
    assert ([o.token_ids for o in lookup.generate(prompts, 8, sampling=sampling)]
            == [o.token_ids for o in ref.generate(prompts, 8, sampling=sampling)])


@pytest.mark.parametrize("sp", [CASES[0], CASES[3]], ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_pt2_samples_have_the_target_distribution(small, sampling_engine, sp):  # noqa: F811
    dec = SpeculativeDecoder.load(sampling_engine, backend="pt2")
    samples = sample(dec, sp, N)
    assert chi2_pvalue(samples, exact_distribution(small["hf"], sp)) > 1e-3
    if sp.top_k == 0 and sp.top_p == 1.0:  # power: clearly not the draft's distribution
        assert chi2_pvalue(samples, exact_distribution(small["hf_draft"], sp)) < 1e-6


def test_pt2_from_another_torch_is_refused(sampling_engine, tmp_path):
    copy = tmp_path / "eng"
    shutil.copytree(sampling_engine, copy)
    path = copy / "manifest.json"
    m = json.loads(path.read_text())
    m["models"]["target"]["pt2"]["torch"] = "2.9.1+cpu"
    path.write_text(json.dumps(m))
    with pytest.raises(SpecExportError) as e:
        SpeculativeDecoder.load(str(copy), backend="pt2")
    msg = str(e.value)
    assert "\n" not in msg and "torch 2.9.1+cpu" in msg and f"torch {torch.__version__}" in msg and "rebuild" in msg
    del m["models"]["target"]["pt2"]
    path.write_text(json.dumps(m))
    with pytest.raises(SpecExportError, match="no pt2 packages: rebuild with --format onnx,pt2"):
        SpeculativeDecoder.load(str(copy), backend="pt2")
    SpeculativeDecoder.load(str(copy), backend="onnxruntime")  # the other formats still load


def test_pt2_refuses_quantized_layers(small, tmp_path):  # noqa: F811
    with pytest.raises(SpecExportError, match="pt2 has no low-bit kernel"):
        build(BuildConfig(target=small["target"], draft="quant:int4:b16", ks=(2,), max_seq_len=16, max_batch=2,
                          prefill_chunk=8, formats=("onnx", "pt2"), out=str(tmp_path / "q")), progress=False)


def test_pt2_captured_steps_through_the_cpu_harness(sampling_engine):
    """The CUDA-graph capture logic over the pt2 graphs (backends/cuda_graphs.py, FakeRuntime with its checks:
    static buffers only, storage kept, poisoned caller inputs): the tokens of the pt2 engine run directly, greedy
    and sampled, with the draft model and with prompt lookup (one-hot q built on the device)."""
    from specexport.backends.cuda_graphs import FakeRuntime
    prompts = [[1, 2, 3, 1, 2], [4, 5, 6, 7], [3, 3, 1]]
    sampling = [SamplingParams(0.9, top_k=5, top_p=0.9, seed=5), SamplingParams(), SamplingParams(1.2, seed=6)]
    for drafter in ("model", "prompt-lookup"):
        plain, captured = (SpeculativeDecoder.load(sampling_engine, backend="pt2", max_batch=4, drafter=drafter)
                           for _ in range(2))
        for eng, role in ((captured.target, "target"), (getattr(captured.drafter, "engine", None), "draft")):
            if eng is not None:
                eng.capture_steps(FakeRuntime(), check=True, role=role)
        for sp in (None, sampling):
            want = [o.token_ids for o in plain.generate(prompts, 8, sampling=sp)]
            assert [o.token_ids for o in captured.generate(prompts, 8, sampling=sp)] == want, (drafter, sp)
        assert 4 in {key[1] for key in captured.target.graphs.graphs}  # 3 rows: the 4-row bucket
