"""`layers:` drafts, the target with fewer layers, over the target's own tensors (models/layer_spec.py, skip.py,
layer_search.py; export/build.py shares tensors a draft has in common with the target)."""

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from helpers import FAMILIES, SHAPES, hf_greedy, make_tiny, watch_draft_writes
from specexport import SamplingParams, SpecExportError, SpeculativeDecoder
from specexport.config import BuildConfig
from specexport.export.build import build
from specexport.export.inspect import describe, format_description
from specexport.models.layer_spec import LayerSpec, format_layers
from test_runtime_sampling import CASES, ENGINE_SHAPES, N, SMALL, chi2_pvalue, exact_distribution, sample

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]]


@pytest.fixture(scope="module")
def layer_engines(tiny, tmp_path_factory):
    """family -> an engine whose draft is the target's layer 0 of 2 (llama also with TorchScript)."""
    root = tmp_path_factory.mktemp("layers")
    return {fam: build(BuildConfig(target=tiny[fam]["target"], draft="layers:0", ks=(1, 3), out=str(root / fam),
                                   formats=("onnx", "torchscript") if fam == "llama" else ("onnx",), **SHAPES),
                       progress=False)["out"] for fam in FAMILIES}


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
@pytest.mark.parametrize("fam", FAMILIES)
def test_layer_draft_greedy_equals_target_and_transformers(tiny, layer_engines, fam, backend):
    dec = SpeculativeDecoder.load(layer_engines[fam], backend=backend, drafter="model")
    assert dec.drafter.name == "layers:0"
    want = [hf_greedy(tiny[fam]["hf"], p, 20) for p in PROMPTS]
    assert [o.token_ids for o in dec.generate(PROMPTS, 20, speculative=False)] == want
    for k in (1, 3, "auto"):
        out = dec.generate(PROMPTS, 20, k=k)
        assert [o.token_ids for o in out] == want, k
    assert sum(o.stats.drafted for o in out) > 0
    hybrid = SpeculativeDecoder.load(layer_engines[fam], backend=backend)  # the default: lookup + layers
    assert [o.token_ids for o in hybrid.generate(PROMPTS, 20, k=3)] == want


def test_a_layers_draft_runs_over_the_targets_cache(tiny, layer_engines):
    """On onnxruntime (fused graphs, host caches) a layers: draft keeps no cache: each of its layers reads and
    writes the target's cache of the target layer it is (drafters.ModelDrafter.link_kv). It never writes a
    committed position (checked on the writes), so the tokens stay the target's at batch 1 and 2, at a fixed k,
    at auto through target-only steps (nothing to catch up) and as the hybrid; the torch backend keeps its own."""
    dec = SpeculativeDecoder.load(layer_engines["llama"], drafter="model")
    n = dec.target.config.num_layers  # 2; the draft is layer 0
    assert dec.drafter.shares_kv and dec.drafter.engine.layers == [0]
    assert [id(a) for a in dec.drafter.engine._kv_np] == [id(dec.target._kv_np[0]), id(dec.target._kv_np[n])]
    assert not SpeculativeDecoder.load(layer_engines["llama"], backend="torch", drafter="model").drafter.shares_kv
    want = [hf_greedy(tiny["llama"]["hf"], p, 20) for p in PROMPTS]
    checked = watch_draft_writes(dec)
    assert [o.token_ids for o in dec.generate(PROMPTS[:1], 20, k=3)] == want[:1]
    assert [o.token_ids for o in dec.generate(PROMPTS, 20, k=3)] == want
    ctl = dec.autok()
    steps = itertools.chain([0] * 4, itertools.cycle([3, 0, 1]))  # target-only steps between drafts
    ctl.plan = lambda B, rows, missing=0, free=None: next(steps)
    assert [o.token_ids for o in dec.generate(PROMPTS, 20, k="auto")] == want
    assert not any(key[0] == "catch_up" for key in ctl.costs.median)
    hybrid = SpeculativeDecoder.load(layer_engines["llama"])
    checked_hybrid = watch_draft_writes(hybrid)
    assert hybrid.drafter.shares_kv and [o.token_ids for o in hybrid.generate(PROMPTS, 20, k=3)] == want
    assert checked["calls"] > 10 and checked_hybrid["calls"] > 3
    info = describe(layer_engines["llama"])
    assert info["models"]["draft"]["kv_target_on_ort_cpu"] and "none of its own" in format_description(info)


def test_a_portable_layers_draft_keeps_its_own_cache(tiny, tmp_path):
    """Portable graphs' draft rewrites the position before the current one: there a layers: draft keeps and fills
    its own cache (its later layers' keys and values are not the target's, so nothing is copied either)."""
    out = build(BuildConfig(target=tiny["llama"]["target"], draft="layers:0", ks=(3,), ops="portable",
                            out=str(tmp_path / "p"), **SHAPES), progress=False)["out"]
    dec = SpeculativeDecoder.load(out, drafter="model")
    assert dec.drafter.engine.mirrors(dec.target)  # it could: the graphs are what keeps it from sharing
    assert not dec.drafter.shares_kv and dec.drafter.kv_source is None and not dec.autok().copy_catch_up
    assert all(a is not b for a in dec.drafter.engine._kv_np for b in dec.target._kv_np)
    want = [hf_greedy(tiny["llama"]["hf"], p, 20) for p in PROMPTS]
    assert [o.token_ids for o in dec.generate(PROMPTS, 20, k=3)] == want
    assert not describe(out)["models"]["draft"]["kv_target_on_ort_cpu"]


def test_layer_draft_torchscript(tiny, layer_engines):
    dec = SpeculativeDecoder.load(layer_engines["llama"], backend="torchscript", drafter="model")
    want = [hf_greedy(tiny["llama"]["hf"], p, 16) for p in PROMPTS]
    assert [o.token_ids for o in dec.generate(PROMPTS, 16, k=3)] == want


def test_layer_draft_shares_every_tensor_with_the_target(layer_engines):
    root = Path(layer_engines["qwen3"])
    m = json.loads((root / "manifest.json").read_text())
    draft = m["models"]["draft"]
    assert draft["layers"] == [0] and draft["config"]["num_layers"] == 1
    assert draft["weights"] == "target/draft.weights.safetensors" and not (root / "draft").exists()
    with safe_open(str(root / draft["weights"]), "pt") as f:
        own = set(f.keys())
    assert not any(".layers." in n or "embed" in n or "lm_head" in n for n in own), own  # nothing copied
    shared = draft["shared"]["tensors"]
    assert shared["model.model.layers.0.self_attn.qkv_proj.weight"] == "model.model.layers.0.self_attn.qkv_proj.weight"
    assert shared["model.lm_head.weight"] == "model.lm_head.weight"
    text = format_description(describe(str(root)))
    assert "1 layers (the target's layers 0)" in text and "shared with the target:" in text


def test_from_checkpoint_eager(tiny):
    t = tiny["mistral"]
    dec = SpeculativeDecoder.from_pretrained(t["target"], "layers:1", k=3, max_seq_len=64, max_batch=2)
    want = [hf_greedy(t["hf"], p, 16) for p in PROMPTS]
    assert [o.token_ids for o in dec.generate(PROMPTS, 16)] == want
    hybrid = SpeculativeDecoder.from_pretrained(t["target"], "prompt-lookup+layers:1", k=3, max_seq_len=64)
    assert [o.token_ids for o in hybrid.generate(PROMPTS, 16)] == want


@pytest.mark.parametrize("spec, msg", [
    ("layers:", r"'\(empty\)' is not a layer or a range"),
    ("layers:0-x", r"'0-x' is not a layer or a range"),
    ("layers:3-1", r"range '3-1' runs backwards"),
    ("layers:0,0", r"names a layer twice"),
    ("layers:0,5", r"keeps layer 5, but the target has 2 layers \(0-1\): choose layers within 0-1"),
    ("layers:0-1", r"keeps all 2 layers, so it is the target itself"),
    ("layers:0:int3", r"not a quantization spec"),
])
def test_layer_lists_that_do_not_fit_get_one_clear_error(tiny, spec, msg):
    with pytest.raises(SpecExportError, match=msg):
        SpeculativeDecoder.from_pretrained(tiny["llama"]["target"], spec, max_seq_len=32)


def test_auto_on_a_one_layer_target_says_there_is_nothing_to_skip(tmp_path):
    make_tiny(tmp_path / "t", "qwen2", num_hidden_layers=1)
    with pytest.raises(SpecExportError, match="the target has 1 layer, so there is none to skip"):
        SpeculativeDecoder.from_pretrained(str(tmp_path / "t"), "layers:auto", max_seq_len=32)


def test_cli_refuses_a_bad_layer_list_before_any_work(tiny, tmp_path):
    r = subprocess.run([sys.executable, "-m", "specexport.cli", "build", "--target", tiny["llama"]["target"],
                        "--draft", "layers:0,7", "--out", str(tmp_path / "e")], capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "keeps layer 7, but the target has 2 layers" in r.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "e").exists()


def test_spec_parsing():
    assert LayerSpec.parse("layers:0-2,5,7-8") == LayerSpec((0, 1, 2, 5, 7, 8))
    assert LayerSpec.parse("layers:auto:int8") == LayerSpec(None, "quant:int8")
    assert format_layers((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8"
    assert LayerSpec.parse("layers:1,0:int4:b16").name((0, 1)) == "layers:0-1:int4:b16"


def test_auto_chooses_on_calibration_text_and_records_the_table(tmp_path, capfd):
    hf = make_tiny(tmp_path / "t", "llama", num_hidden_layers=4, logit_scale=4.0, tie_word_embeddings=False)
    out = build(BuildConfig(target=str(tmp_path / "t"), draft="layers:auto", ks=(2,), sampling=False,
                            out=str(tmp_path / "e"), **SHAPES))["out"]
    err = capfd.readouterr().err
    m = json.loads((Path(out) / "manifest.json").read_text())
    d = m["models"]["draft"]
    search = d["layer_search"]
    assert len(search["table"]) == 3  # drop 1, 2 or 3 of 4 layers
    assert search["chosen"] == max(search["table"], key=lambda r: r["predicted"])
    assert tuple(d["layers"]) == LayerSpec.parse("layers:" + search["chosen"]["keep"]).keep
    assert d["source"] == "layers:" + search["chosen"]["keep"]
    assert "layers:auto on 6 calibration prompts" in err and "<- chosen" in err
    dec = SpeculativeDecoder.load(out, backend="onnxruntime", drafter="model")
    want = [hf_greedy(hf, p, 16) for p in PROMPTS]
    assert [o.token_ids for o in dec.generate(PROMPTS, 16, k=2)] == want


def test_quantized_layer_draft_holds_only_codes(tiny, tmp_path):
    t = tiny["qwen2"]
    out = build(BuildConfig(target=t["target"], draft="layers:1:int8", ks=(2,), sampling=False,
                            out=str(tmp_path / "e"), **SHAPES), progress=False)["out"]
    m = json.loads((Path(out) / "manifest.json").read_text())
    draft = m["models"]["draft"]
    with safe_open(str(Path(out) / draft["weights"]), "pt") as f:
        own = set(f.keys())
    assert any(n.endswith("qkv_proj.qweight") for n in own)
    assert not any(n.endswith("proj.weight") for n in own)  # no float copy of a linear
    assert "model.model.embed_tokens.weight" in draft["shared"]["tensors"]  # the embedding is the target's
    dec = SpeculativeDecoder.load(out, backend="onnxruntime", drafter="model")
    want = [o.token_ids for o in dec.generate(PROMPTS, 16, speculative=False)]
    assert [o.token_ids for o in dec.generate(PROMPTS, 16, k=2)] == want


def test_quantized_copy_reads_the_targets_embedding(tiny, tmp_path):
    """quant:int8 keeps the embedding in float: identical to the target's, so it is shared, not copied."""
    out = build(BuildConfig(target=tiny["llama"]["target"], draft="quant:int8", ks=(2,), sampling=False,
                            out=str(tmp_path / "e"), **SHAPES), progress=False)["out"]
    draft = json.loads((Path(out) / "manifest.json").read_text())["models"]["draft"]
    assert draft["shared"]["tensors"]["model.model.embed_tokens.weight"] == "model.model.embed_tokens.weight"


# ---- sampling: the target's exact distribution --------------------------------------------------------

@pytest.fixture(scope="module")
def small2(tmp_path_factory):
    """A 2-layer model over V tokens (tests/test_runtime_sampling.py's enumeration); the draft keeps layer 1."""
    root = tmp_path_factory.mktemp("small2")
    hf = make_tiny(root / "target", "qwen2", seed=1, logit_scale=6.0, **SMALL, num_hidden_layers=2)
    out = build(BuildConfig(target=str(root / "target"), draft="layers:1", out=str(root / "eng"), **ENGINE_SHAPES),
                progress=False)["out"]
    return dict(hf=hf, engine=out)


@pytest.mark.parametrize("backend, drafter, sp", [("onnxruntime", "model", CASES[0]),
                                                  ("onnxruntime", "model", CASES[3]),
                                                  ("onnxruntime", "hybrid", CASES[1]),
                                                  ("torch", "model", CASES[0])])
def test_layer_draft_samples_have_the_target_distribution(small2, backend, drafter, sp):
    """2N samples: with N, the onnxruntime hybrid case's seeds 0..N-1 gave p = 0.0003 once the draft ran over the
    target's cache (the seeds after them, 0.71, 0.54 and 0.16; with 4N samples, every case 0.09-0.43)."""
    dec = SpeculativeDecoder.load(small2["engine"], backend=backend, drafter=drafter)
    samples = sample(dec, sp, 2 * N)
    assert chi2_pvalue(samples, exact_distribution(small2["hf"], sp)) > 1e-3
    assert sum(1 for s in set(samples)) > 1


def test_layer_draft_same_seed_same_tokens(small2):
    dec = SpeculativeDecoder.load(small2["engine"], backend="onnxruntime", drafter="model")
    t, e = dec.target, dec.drafter.engine  # its one layer is the target's second: it runs over that layer's cache
    assert dec.drafter.shares_kv and e._kv_np[0] is t._kv_np[1] and e._kv_np[1] is t._kv_np[3]
    assert e.kv[0] is t.kv[1] and e.kv[1] is t.kv[3]  # (the values the bindings use)
    sp = [SamplingParams(1.0, seed=s) for s in (7, 7, 8)]
    a = [o.token_ids for o in dec.generate([[1, 2, 3]] * 3, 8, sampling=sp)]
    b = [o.token_ids for o in dec.generate([[1, 2, 3]] * 3, 8, sampling=sp)]
    assert a == b and a[0] == a[1]


# ---- memory: a shared tensor is held once ---------------------------------------------------------------

MEASURE = """
import json, sys
from specexport import SpeculativeDecoder
def rss():  # (not Pss: the test process may map the same files, which would halve their share here)
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/smaps_rollup") if l.startswith("Rss:"))
before = rss()
dec = SpeculativeDecoder.load(sys.argv[1], backend="onnxruntime", drafter=sys.argv[2], max_batch=1,
                              prepack=sys.argv[3] == "True")
prompt = ([5, 6, 7, 8, 9, 10, 11] * int(sys.argv[4]))[:int(sys.argv[4])]
for _ in range(2):
    dec.generate(prompt, 24, speculative=sys.argv[2] != "prompt-lookup")
print(json.dumps(rss() - before))
"""


def draft_extra_bytes(engine: str, prepack: bool, prompt_len: int = 10) -> int:
    """Resident memory (RSS) the draft adds to a loaded, warmed engine (two generations of 24 tokens after a prompt
    of prompt_len), measured in fresh processes."""
    run = lambda drafter: json.loads(subprocess.run(  # noqa: E731
        [sys.executable, "-c", MEASURE, engine, drafter, str(prepack), str(prompt_len)], capture_output=True,
        text=True, check=True).stdout)
    return run("model") - run("prompt-lookup")


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("prepack", [False, True])
def test_shared_tensors_exist_once_in_memory(tmp_path, prepack):
    """A layers: draft over half the layers adds < 0.1x the target's weights; a separate draft of the same shape
    (own tensors) adds about its own size, so the measurement sees a copy when there is one. Pre-packed, the
    draft's sessions find the target's packed weights in the shared container (backends/ort_capi.py)."""
    kw = dict(vocab_size=32000, hidden_size=384, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=6,
              num_key_value_heads=2)
    make_tiny(tmp_path / "t", "llama", **kw)
    make_tiny(tmp_path / "d", "llama", seed=3, **{**kw, "num_hidden_layers": 2})
    shape = dict(ks=(3,), max_seq_len=256, max_batch=1, prefill_chunk=16, sampling=False,
                 target_head="full")  # (the target's certified head maps rows of its head as it reads them)
    shared = build(BuildConfig(target=str(tmp_path / "t"), draft="layers:0,2", out=str(tmp_path / "s"), **shape),
                   progress=False)
    separate = build(BuildConfig(target=str(tmp_path / "t"), draft=str(tmp_path / "d"), out=str(tmp_path / "c"),
                                 **shape), progress=False)
    target_bytes = shared["files"]["target/weights.safetensors"]
    sep = json.loads((Path(separate["out"]) / "manifest.json").read_text())["models"]["draft"]
    draft_bytes = separate["files"][sep["weights"]]  # its own tensors: the layers: draft's shapes
    assert draft_bytes > 0.7 * target_bytes
    extra_shared, extra_separate = (draft_extra_bytes(e["out"], prepack) for e in (shared, separate))
    assert extra_separate > 0.8 * draft_bytes, (extra_separate, draft_bytes)
    # measured 0.056x; pre-packed 0.11x (with its own cache, before it ran over the target's): the draft's own
    # sessions' allocations weigh more against this small target (on SmolLM2 fp32 the pre-packed layers: draft
    # adds 0.018x over the target's cache, 0.029x with its own)
    assert extra_shared < (0.15 if prepack else 0.1) * target_bytes, (extra_shared, target_bytes)
