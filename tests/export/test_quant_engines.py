"""Engines whose draft is a quantized copy of the target (MatMulNBits in ONNX Runtime): the tokens stay the
target's at every k, target-only and auto, on onnxruntime and torch; seeds repeat; load-time drafter choice."""

import itertools

import numpy as np
import pytest

from helpers import hf_greedy
from specexport import SamplingParams, SpeculativeDecoder, SpecExportError
from specexport.config import BuildConfig
from specexport.export.build import build
from specexport.export.loader import open_draft
from test_runtime_greedy import NEW, PROMPTS

SHAPES = dict(max_seq_len=128, max_batch=4, prefill_chunk=16)


@pytest.fixture(scope="module")
def quant_engines(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    out = {}
    for spec, ks in (("quant:int8", (1, 3)), ("quant:int4:b16:sym", (3,))):
        cfg = BuildConfig(target=tiny["llama"]["target"], draft=spec, ks=ks, out=str(root / spec.replace(":", "-")),
                          **SHAPES)
        out[spec] = build(cfg, progress=False)["out"]
    return out


@pytest.fixture(scope="module")
def reference(tiny):
    return [hf_greedy(tiny["llama"]["hf"], p, NEW) for p in PROMPTS]


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
@pytest.mark.parametrize("spec", ["quant:int8", "quant:int4:b16:sym"])
def test_quantized_draft_greedy_equals_transformers(quant_engines, reference, spec, backend):
    dec = SpeculativeDecoder.load(quant_engines[spec], backend=backend, drafter="model")
    assert dec.drafter.name == ("quant:int8:b32:asym" if spec == "quant:int8" else "quant:int4:b16:sym")
    hybrid = SpeculativeDecoder.load(quant_engines[spec], backend=backend)  # the default with a draft model
    assert hybrid.drafter.name == "prompt-lookup+" + dec.drafter.name
    assert [o.token_ids for o in hybrid.generate(PROMPTS, NEW, k="auto")] == reference
    for k in (*dec.target.ks, "auto"):
        outs = dec.generate(PROMPTS, NEW, k=k)
        assert [o.token_ids for o in outs] == reference, f"k={k}"
    assert [o.token_ids for o in dec.generate(PROMPTS, NEW, speculative=False)] == reference
    outs = dec.generate(PROMPTS, NEW, k=3)
    if spec == "quant:int8":  # an 8-bit copy agrees with its target almost everywhere
        assert sum(o.stats.accepted for o in outs) > 0.8 * sum(o.stats.drafted for o in outs)


def test_same_seed_same_tokens(quant_engines):
    dec = SpeculativeDecoder.load(quant_engines["quant:int8"])
    sampling = [SamplingParams(0.9, top_k=20, seed=5), SamplingParams(), SamplingParams(1.2, seed=6)]
    for k in (1, 3):
        a = [o.token_ids for o in dec.generate(PROMPTS, NEW, sampling=sampling, k=k)]
        assert a == [o.token_ids for o in dec.generate(PROMPTS, NEW, sampling=sampling, k=k)]


def test_drafter_choice_at_load(quant_engines, reference):
    dec = SpeculativeDecoder.load(quant_engines["quant:int8"], drafter="prompt-lookup")
    assert dec.drafter.name == "prompt-lookup"
    assert [o.token_ids for o in dec.generate(PROMPTS, NEW, k=3)] == reference
    with pytest.raises(SpecExportError, match="drafter='bogus'"):
        SpeculativeDecoder.load(quant_engines["quant:int8"], drafter="bogus")
    drafter, ks = open_draft(quant_engines["quant:int8"])
    assert ks == (1, 3) and drafter.name == "quant:int8:b32:asym"


def test_torchscript_is_refused_for_quantized_drafts(tiny, tmp_path):
    cfg = BuildConfig(target=tiny["llama"]["target"], draft="quant:int4", formats=("onnx", "torchscript"),
                      out=str(tmp_path / "e"), **SHAPES)
    with pytest.raises(SpecExportError, match="ONNX .MatMulNBits. only"):
        build(cfg, progress=False)
    assert not (tmp_path / "e").exists()


def test_bad_quant_spec_fails_before_any_work(tiny, tmp_path):
    cfg = BuildConfig(target=tiny["llama"]["target"], draft="quant:int5", out=str(tmp_path / "e"), **SHAPES)
    with pytest.raises(SpecExportError, match="quant:int4 or quant:int8"):
        build(cfg, progress=False)


def test_the_draft_cache_is_copied_from_the_target(quant_engines, reference):
    """A quantized copy has the target's layers: on onnxruntime (host caches of one layout) its prompt and its
    catch-up after target-only steps are the target's cached keys and values, copied, instead of draft passes;
    the tokens stay the target's, and the draft still proposes what the target accepts."""
    dec = SpeculativeDecoder.load(quant_engines["quant:int8"], drafter="model")
    assert dec.drafter.kv_source is dec.target and dec.autok().copy_catch_up
    assert SpeculativeDecoder.load(quant_engines["quant:int8"], backend="torch", drafter="model").drafter.kv_source \
        is None  # the torch engine keeps its caches as tensors: the draft prefills
    prompt = PROMPTS[0]
    outs = dec.generate([prompt], NEW, k=3)
    assert [o.token_ids for o in outs] == reference[:1]
    assert outs[0].stats.accepted > 0.8 * outs[0].stats.drafted
    n = len(prompt) - 1  # positions the draft never rewrote: exactly the target's
    for mine, theirs in zip(dec.drafter.engine._kv_np, dec.target._kv_np):
        assert np.array_equal(mine[0, :, :n], theirs[0, :, :n])
    ctl = dec.autok()
    steps = itertools.chain([0] * 6, itertools.repeat(3))  # six target-only steps, then a catch-up by copy
    ctl.plan = lambda B, rows, missing=0, free=None: next(steps)
    outs = dec.generate(PROMPTS, NEW, k="auto")
    assert [o.token_ids for o in outs] == reference
    assert any(key[:2] == ("catch_up", "copy") for key in ctl.costs.median)
