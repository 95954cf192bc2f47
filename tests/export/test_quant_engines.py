"""Engines whose draft is a quantized copy of the target (MatMulNBits in ONNX Runtime): the tokens stay the
target's at every k, target-only and auto, on onnxruntime and torch; seeds repeat; load-time drafter choice."""

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from helpers import hf_greedy, make_tiny, watch_draft_writes
from specexport import SamplingParams, SpeculativeDecoder, SpecExportError
from specexport.config import BuildConfig
from specexport.export.build import build
from specexport.export.inspect import describe, format_description
from specexport.engine_dir import open_draft
from test_layer_drafts import draft_extra_bytes
from test_runtime_greedy import NEW, PROMPTS

SHAPES = dict(max_seq_len=128, max_batch=4, prefill_chunk=16)


@pytest.fixture(scope="module")
def quant_engines(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    out = {}
    for spec, ks in (("quant:int8", (1, 3)), ("quant:int4:b16:sym", (3,)), ("quant:int8:smooth0:head0", (3,))):
        cfg = BuildConfig(target=tiny["llama"]["target"], draft=spec, ks=ks, out=str(root / spec.replace(":", "-")),
                          **SHAPES)
        out[spec] = build(cfg, progress=False)["out"]
    return out


@pytest.fixture(scope="module")
def reference(tiny):
    return [hf_greedy(tiny["llama"]["hf"], p, NEW) for p in PROMPTS]


NAMES = {"quant:int8": "quant:int8:b32:asym:smooth0.6:head4",  # (smoothed, with a rescored head, by default:
         "quant:int4:b16:sym": "quant:int4:b16:sym:smooth0.6:head4",  # models/smooth.py, models/rescore.py)
         "quant:int8:smooth0:head0": "quant:int8:b32:asym:smooth0:head0"}


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
@pytest.mark.parametrize("spec", list(NAMES))
def test_quantized_draft_greedy_equals_transformers(quant_engines, reference, spec, backend):
    dec = SpeculativeDecoder.load(quant_engines[spec], backend=backend, drafter="model")
    assert dec.drafter.name == NAMES[spec]
    hybrid = SpeculativeDecoder.load(quant_engines[spec], backend=backend)  # the default with a draft model
    assert hybrid.drafter.name == "prompt-lookup+" + dec.drafter.name
    assert [o.token_ids for o in hybrid.generate(PROMPTS, NEW, k="auto")] == reference
    for k in (*dec.target.ks, "auto"):
        outs = dec.generate(PROMPTS, NEW, k=k)
        assert [o.token_ids for o in outs] == reference, f"k={k}"
    assert [o.token_ids for o in dec.generate(PROMPTS, NEW, speculative=False)] == reference
    outs = dec.generate(PROMPTS, NEW, k=3)
    if spec == "quant:int8":  # smoothed: the embedding is still read from the target's file
        emb = describe(quant_engines[spec])["models"]["draft"]
        assert emb["shared_bytes"] >= 96 * 64 * 4, emb  # (the tiny model's vocab x hidden, fp32)
    if spec != "quant:int4:b16:sym":  # an 8-bit copy agrees with its target almost everywhere
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
    assert ks == (1, 3) and drafter.name == "quant:int8:b32:asym:smooth0.6:head4"


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


def test_the_draft_reads_and_writes_the_targets_cache(quant_engines, reference):
    """A quantized copy has the target's layers: on onnxruntime (host caches of one layout) a fused draft keeps no
    cache of its own and runs over the target's (drafters.ModelDrafter.link_kv). It never writes a committed
    position (checked on the writes themselves: the tokens alone would not show it, an int8 copy's keys and values
    are too close to the target's to flip a greedy token of this tiny model), so the tokens stay the target's at
    batch 1 and 3, at a fixed k, at auto through target-only steps (nothing to catch up), as the hybrid and
    sampling; and the draft still proposes what the target accepts."""
    dec = SpeculativeDecoder.load(quant_engines["quant:int8"], drafter="model")
    assert dec.drafter.kv_source is dec.target and dec.drafter.shares_kv
    for mine, theirs in zip(dec.drafter.engine._kv_np, dec.target._kv_np):
        assert mine is theirs
    assert not SpeculativeDecoder.load(quant_engines["quant:int8"], backend="torch", drafter="model").drafter.shares_kv
    checked = watch_draft_writes(dec)
    outs = dec.generate([PROMPTS[0]], NEW, k=3)
    assert [o.token_ids for o in outs] == reference[:1]
    assert outs[0].stats.accepted > 0.8 * outs[0].stats.drafted
    assert [o.token_ids for o in dec.generate(PROMPTS, NEW, k=3)] == reference
    ctl = dec.autok()
    steps = itertools.chain([0] * 6, itertools.cycle([3, 0, 1]))  # target-only steps between drafts
    ctl.plan = lambda B, rows, missing=0, free=None: next(steps)
    outs = dec.generate(PROMPTS, NEW, k="auto")
    assert [o.token_ids for o in outs] == reference
    assert sum(o.stats.accepted for o in outs) > 0.8 * sum(o.stats.drafted for o in outs) > 0
    assert not any(key[0] == "catch_up" for key in ctl.costs.median)
    hybrid = SpeculativeDecoder.load(quant_engines["quant:int8"])  # the default: lookup + the model
    assert hybrid.drafter.shares_kv
    checked_hybrid = watch_draft_writes(hybrid)
    assert [o.token_ids for o in hybrid.generate(PROMPTS, NEW, k=3)] == reference
    sample = lambda: [o.token_ids for o in hybrid.generate(PROMPTS, NEW, k=3,  # noqa: E731
                                                           sampling=SamplingParams(0.9, seed=4))]
    assert sample() == sample()  # (the sampling graphs' draft calls are watched too)
    assert checked["calls"] > 20 and checked_hybrid["calls"] > 10
    info = describe(quant_engines["quant:int8"])  # inspect says so, and counts the pair's memory without it
    assert info["models"]["draft"]["kv_target_on_ort_cpu"] and "none of its own" in format_description(info)
    assert info["memory"]["kv_bytes_max_batch_ort_cpu"] == info["models"]["target"]["kv_bytes_max_batch"]
    with pytest.raises(SpecExportError, match="another target's cache"):  # one draft engine, one target
        dec.drafter.link_kv(hybrid.target)


def test_the_hybrids_model_hands_over_to_lookup_and_keeps_the_targets_tokens(quant_engines, reference):
    """Over the target's cache the hybrid's model ends its chain of passes once its drafts complete a lookup match
    (drafters.HybridDrafter): greedy tokens stay the target's at a fixed k, at auto and at batch 1 and 3, and
    the steps that hand over run fewer passes than k."""
    hybrid = SpeculativeDecoder.load(quant_engines["quant:int8"], min_margin=0)  # (the margin stop: its own test)
    assert hybrid.drafter.shares_kv and hybrid.drafter.handover
    assert hybrid.autok().handover  # auto promises such a chain all k drafts (autok.AutoK.model_tokens)
    passes = []
    propose = hybrid.drafter.model.propose
    hybrid.drafter.model.propose = lambda x, k, *a: passes.append((k, p := propose(x, k, *a))) or p
    for k in (3, "auto"):
        outs = hybrid.generate(PROMPTS, NEW, k=k)
        assert [o.token_ids for o in outs] == reference, k
        assert [o.token_ids for o in hybrid.generate(PROMPTS[1:2], NEW, k=k)] == reference[1:2], k
        if k == 3:
            assert sum(o.stats.steps_by.get("model+lookup", 0) for o in outs) > 0
    assert any(p.passes < k for k, p in passes)  # a chain that ended early
    off = SpeculativeDecoder.load(quant_engines["quant:int8"], handover=False)
    assert not off.drafter.handover and not off.autok().handover
    assert not SpeculativeDecoder.load(quant_engines["quant:int8"], drafter="model").autok().handover
    outs = off.generate(PROMPTS, NEW, k=3)
    assert [o.token_ids for o in outs] == reference and not any("model+lookup" in o.stats.steps_by for o in outs)


def test_a_handover_verified_part_way_keeps_the_targets_tokens(quant_engines, reference):
    """At auto a handover's lookup rest is verified only as far as it pays (AutoK.handover_width, cut here to the
    model's own tokens on every step): greedy tokens stay the target's, batch 3 and 1."""
    hybrid = SpeculativeDecoder.load(quant_engines["quant:int8"], min_margin=0)
    ctl, cut = hybrid.autok(), []
    ctl.plan = lambda B, rows, missing=0, free=None: 3

    def handover_width(B, rows, heads, lens, sources, passes):
        cut.append(max(lens) > max(heads))
        return max(heads)
    ctl.handover_width = handover_width
    assert [o.token_ids for o in hybrid.generate(PROMPTS, NEW, k="auto")] == reference
    assert [o.token_ids for o in hybrid.generate(PROMPTS[1:2], NEW, k="auto")] == reference[1:2]
    assert any(cut)


def test_a_portable_draft_copies_the_targets_cache(tiny, tmp_path, reference):
    """Portable graphs' draft rewrites the position before the current one, so it keeps its own cache: its prompt
    and its catch-up after target-only steps are the target's keys and values, copied, instead of draft passes."""
    cfg = BuildConfig(target=tiny["llama"]["target"], draft="quant:int8", ks=(3,), ops="portable",
                      out=str(tmp_path / "p"), **SHAPES)
    dec = SpeculativeDecoder.load(build(cfg, progress=False)["out"], drafter="model")
    assert dec.drafter.kv_source is dec.target and not dec.drafter.shares_kv and dec.autok().copy_catch_up
    prompt = PROMPTS[0]
    outs = dec.generate([prompt], NEW, k=3)
    assert [o.token_ids for o in outs] == reference[:1]
    assert outs[0].stats.accepted > 0.8 * outs[0].stats.drafted
    n = len(prompt) - 1  # positions the draft never rewrote: exactly the target's
    for mine, theirs in zip(dec.drafter.engine._kv_np, dec.target._kv_np):
        assert mine is not theirs and np.array_equal(mine[0, :, :n], theirs[0, :, :n])
    ctl = dec.autok()
    steps = itertools.chain([0] * 6, itertools.repeat(3))  # six target-only steps, then a catch-up by copy
    ctl.plan = lambda B, rows, missing=0, free=None: next(steps)
    outs = dec.generate(PROMPTS, NEW, k="auto")
    assert [o.token_ids for o in outs] == reference
    assert any(key[:2] == ("catch_up", "copy") for key in ctl.costs.median)


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux /proc")
def test_a_draft_over_the_targets_cache_adds_no_cache_memory(tmp_path):
    """Measured, not read from a flag: after a 6,000-token prompt, a draft that keeps its own cache (the int8 copy
    in portable graphs, its cache copied from the target's) adds about its cache's resident size; the fused int8
    copy and the fused `layers:` draft (3 of 4 layers), over the target's cache, add only their codes (the
    layers: draft has none: it reads the target's tensors) and sessions."""
    make_tiny(tmp_path / "t", "llama", vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=4)
    shape = dict(ks=(3,), max_seq_len=8192, max_batch=1, prefill_chunk=256, sampling=False)
    specs = {"own": ("quant:int8", "portable"), "int8": ("quant:int8", "fused"), "layers": ("layers:0,1,2", "fused")}
    n = 6000
    kv_touched = n * 4 * 2 * 128 * 4  # prompt positions x layers x (keys, values) x Hkv*D x fp32: 24.6 MB
    extra = {name: draft_extra_bytes(build(BuildConfig(target=str(tmp_path / "t"), draft=spec, ops=ops,
                                                       out=str(tmp_path / name), **shape), progress=False)["out"],
                                     True, n) for name, (spec, ops) in specs.items()}
    assert extra["own"] > 0.6 * kv_touched, extra  # the measurement sees a cache where there is one
    # measured: the int8 copy 8.3 MB (its codes, their packed copies and its sessions; with its own cache, copied
    # from the target's, it added 32.3 MB); the layers: draft, with its own cache, added 0.6-0.75x the touched KV
    assert extra["int8"] < 0.5 * kv_touched and extra["layers"] < 0.5 * kv_touched, (extra, kv_touched)


def test_the_margin_stop_ends_a_rows_drafts_after_a_near_tie_and_keeps_the_targets_tokens(quant_engines, reference):
    """A fused draft reports each draft token's margin (top logit - runner-up; the greedy graph's TopK and the
    sampling graph's q at temperature 1 agree on it), and a row's chain ends after a draft whose margin is under
    min_margin (drafters.ModelDrafter): greedy tokens stay the target's at a fixed k and at auto, batch 1 and 3,
    in the model alone and in the hybrid, while fewer passes run."""
    from specexport.sampling import SamplingRows
    dec = SpeculativeDecoder.load(quant_engines["quant:int8"], drafter="model", min_margin=0)
    eng, seen = dec.drafter.engine, []
    draft = eng.draft

    def both_modes(last_two, past_len, kv_len, k, sampling, u, until=None):
        B, got = len(last_two), []
        for mode in (None, SamplingRows(np.ones(B, np.float32), np.zeros(B, np.int64), np.ones(B, np.float32),
                                        np.ones(B, bool))):
            rec = []
            d, _ = draft(last_two, past_len, kv_len, k, mode, np.zeros((B, k), np.float32),
                         lambda drafts, margin: rec.append(margin) or False)
            got.append((d, rec[-1]))
        assert np.array_equal(got[0][0], got[1][0])
        np.testing.assert_allclose(got[0][1], got[1][1], rtol=1e-3, atol=1e-4)
        seen.append(got[0][1])
        return draft(last_two, past_len, kv_len, k, sampling, u, until)

    eng.draft = both_modes
    assert [o.token_ids for o in dec.generate(PROMPTS, NEW, k=3)] == reference
    margins = np.concatenate([m.ravel() for m in seen])
    assert (margins >= 0).all() and len(margins) > 20
    cut = float(np.median(margins))  # about half the drafts end their row's chain
    for drafter in ("model", "hybrid"):
        dec = SpeculativeDecoder.load(quant_engines["quant:int8"], drafter=drafter, min_margin=cut, handover=False)
        model = getattr(dec.drafter, "model", dec.drafter)
        assert model.min_margin == cut
        props = []
        propose = model.propose
        model.propose = lambda x, k, *a: props.append((k, p := propose(x, k, *a))) or p
        for k in (3, "auto"):
            assert [o.token_ids for o in dec.generate(PROMPTS, NEW, k=k)] == reference, (drafter, k)
            assert [o.token_ids for o in dec.generate(PROMPTS[1:2], NEW, k=k)] == reference[1:2], (drafter, k)
        assert any(p.passes < k for k, p in props) and any(p.draft_len.min() < p.passes for k, p in props)
    with pytest.raises(SpecExportError, match="min_margin"):
        SpeculativeDecoder.load(quant_engines["quant:int8"], min_margin=-1)
    from specexport.backends.ort_engine import _margins  # sampled rows have no tie to stop at
    q = np.array([[0.5, 0.25, 0.25], [0.5, 0.25, 0.25], [1.0, 0.0, 0.0]], np.float32)
    assert np.allclose(_margins(q, np.array([True, False, True])), [np.log(2), np.inf, np.inf])


def test_a_tied_targets_embedding_is_shared_once_as_the_rescored_heads_weight(tmp_path):
    """A tied target's head is its embedding: the copy reads that one tensor under two names (its embedding and its
    rescored head's exact weight, models/rescore.py), which the manifest counts once; the tokens stay the
    target's."""
    make_tiny(tmp_path / "t", "llama", tie_word_embeddings=True, logit_scale=4.0)
    out = build(BuildConfig(target=str(tmp_path / "t"), draft="quant:int8", ks=(3,), out=str(tmp_path / "e"),
                            **SHAPES), progress=False)["out"]
    shared = json.loads((Path(out) / "manifest.json").read_text())["models"]["draft"]["shared"]
    assert shared["tensors"]["model.lm_head.exact"] == "model.model.embed_tokens.weight"
    with safe_open(str(Path(out) / shared["file"]), "np") as f:
        size = {n: f.get_tensor(n).nbytes for n in set(shared["tensors"].values())}
    assert shared["bytes"] == sum(size.values()), shared  # each target tensor once
    dec = SpeculativeDecoder.load(out, drafter="model")
    assert [o.token_ids for o in dec.generate(PROMPTS, NEW, k=3)] == \
        [o.token_ids for o in dec.generate(PROMPTS, NEW, speculative=False)]
