"""Sampling through the ONNX Runtime engine (acceptance rule inside the graph) has the target's exact
distribution: the chi-square test of tests/test_runtime_sampling.py, run on a built engine."""

from collections import Counter

import pytest

from specexport import SamplingParams, SpeculativeDecoder
from specexport.config import BuildConfig
from specexport.export.build import build
from test_runtime_sampling import (CASES, ENGINE_SHAPES, N, NEW, chi2_pvalue, exact_distribution,  # noqa: F401
                                   sample, small)  # (small: a fixture)


@pytest.fixture(scope="module")
def engine_dir(small, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("sampling") / "eng"
    build(BuildConfig(target=small["target"], draft=small["draft"], out=str(out), **ENGINE_SHAPES), progress=False)
    return str(out)


@pytest.fixture(scope="module")
def engine(engine_dir):
    return SpeculativeDecoder.load(engine_dir, backend="onnxruntime")  # the hybrid: lookup where it matches


@pytest.mark.parametrize("sp", [CASES[0], CASES[1], CASES[3]], ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_onnxruntime_samples_have_the_target_distribution(small, engine, sp):  # noqa: F811
    """The graphs' filter sorts no logit (CASES[0]), the top-k largest (CASES[1]) or all (CASES[3]):
    verify._SizedFilter."""
    assert engine.drafter.name.startswith("prompt-lookup+")
    samples = sample(engine, sp, N)
    assert chi2_pvalue(samples, exact_distribution(small["hf"], sp)) > 1e-3
    if sp.top_k == 0 and sp.top_p == 1.0:  # power: clearly not the draft's distribution
        assert chi2_pvalue(samples, exact_distribution(small["hf_draft"], sp)) < 1e-6


def test_onnxruntime_model_drafter_samples_have_the_target_distribution(small, engine_dir):  # noqa: F811
    dec = SpeculativeDecoder.load(engine_dir, backend="onnxruntime", drafter="model")
    samples = sample(dec, CASES[3], N)
    assert chi2_pvalue(samples, exact_distribution(small["hf"], CASES[3])) > 1e-3


def test_onnxruntime_target_only_sampling(small, engine):  # noqa: F811
    sp = CASES[3]
    samples = sample(engine, sp, N, speculative=False)
    assert chi2_pvalue(samples, exact_distribution(small["hf"], sp)) > 1e-3


@pytest.fixture(scope="module")
def narrow_nucleus_engine(small, tmp_path_factory):  # noqa: F811
    """The engine built with the top-p filter's first sort at 2 logits: a nucleus wider than that takes the
    full sort (verify._SizedFilter), as a high-entropy position of a 49k vocabulary does past NUCLEUS."""
    from specexport import verify
    out = tmp_path_factory.mktemp("sampling") / "narrow"
    old, verify.NUCLEUS = verify.NUCLEUS, 2
    try:
        build(BuildConfig(target=small["target"], draft=small["draft"], out=str(out), **ENGINE_SHAPES), progress=False)
    finally:
        verify.NUCLEUS = old
    return SpeculativeDecoder.load(str(out), backend="onnxruntime")


@pytest.mark.parametrize("sp", [CASES[2], CASES[3]], ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_top_p_past_the_first_sort_has_the_target_distribution(small, narrow_nucleus_engine, sp):  # noqa: F811
    samples = sample(narrow_nucleus_engine, sp, N)
    assert chi2_pvalue(samples, exact_distribution(small["hf"], sp)) > 1e-3


@pytest.fixture(scope="module")
def quant_engine(small, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("sampling") / "quant"
    build(BuildConfig(target=small["target"], draft="quant:int4:b16", out=str(out), **ENGINE_SHAPES), progress=False)
    return SpeculativeDecoder.load(str(out), backend="onnxruntime")


@pytest.mark.parametrize("k", [2, "auto"])
def test_quantized_draft_samples_have_the_target_distribution(small, quant_engine, k):  # noqa: F811
    """The draft's q comes from MatMulNBits with int8 activations; the rule keeps p exact, fixed k or auto."""
    sp = CASES[0]
    samples = sample(quant_engine, sp, N, k=k)
    assert chi2_pvalue(samples, exact_distribution(small["hf"], sp)) > 1e-3


@pytest.fixture(scope="module")
def quant_target_dir(small, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("sampling") / "quant_target"
    build(BuildConfig(target=small["target"], draft=small["draft"], target_quant="int4:b16", ks=(2,), max_seq_len=16,
                      max_batch=100, prefill_chunk=8, out=str(out)), progress=False)
    return str(out)


@pytest.fixture(scope="module")
def quant_target_engine(quant_target_dir):
    return SpeculativeDecoder.load(quant_target_dir, backend="onnxruntime", batch_invariant=True)


def engine_distribution(dec, sp) -> dict[tuple, float]:
    """exact_distribution over the engine's own target logits (its prefill graph: MatMulNBits with int8
    activations defines this target, so transformers' logits over dequantized weights are not it)."""
    import itertools

    import numpy as np
    import torch
    from test_runtime_sampling import NEW, PROMPT, V
    from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    procs = LogitsProcessorList([TemperatureLogitsWarper(sp.temperature)]
                                + ([TopKLogitsWarper(sp.top_k)] if sp.top_k else [])
                                + ([TopPLogitsWarper(sp.top_p)] if sp.top_p < 1 else []))
    C, probs = dec.config.prefill_chunk, {}
    for prefix_len in range(NEW):
        for pre in itertools.product(range(V), repeat=prefix_len):
            ids = PROMPT + list(pre)
            chunk = np.array([ids + [0] * (C - len(ids))], dtype=np.int64)
            logits = torch.from_numpy(dec.target.prefill(chunk, np.zeros(1, dtype=np.int64),
                                                         np.array([len(ids) - 1], dtype=np.int64), C))
            row = procs(None, logits.clone()).softmax(-1)[0]
            for t in range(V):
                probs[pre + (t,)] = probs.get(pre, 1.0) * float(row[t])
    return {s: v for s, v in probs.items() if len(s) == NEW}


@pytest.mark.parametrize("k, batch, n", [(2, 100, N), ("auto", 100, 3 * N), ("auto", 1, N)])
def test_quantized_target_samples_have_its_own_distribution(small, quant_target_engine, k, batch, n):  # noqa: F811
    """An int4 target (MatMulNBits, int8 activations): sampled output has the engine's own target distribution,
    one row at a time and in batches of 100 (chunks of 16: the per-row-attention variants), loaded
    batch_invariant: batched target-only steps then run attention per row through the multi-row kernel like
    every verify pass (README: exactness). auto at batch 100 draws 3N samples: over seeds 0..N-1 alone its p
    was 3e-4..4e-3 at batch 10 and 100, with batch_invariant and without it (k="auto" depends on measured
    times, so the figure moves between runs), 0.03 over 2N and 0.24 over 3N; other seed sets of N gave 0.25,
    0.36 and 0.71."""
    sp = CASES[0]
    exact = engine_distribution(quant_target_engine, sp)
    samples = sample(quant_target_engine, sp, n, k=k, batch=batch)
    assert chi2_pvalue(samples, exact) > 1e-3
    assert chi2_pvalue(samples, exact_distribution(small["hf_draft"], sp)) < 1e-6  # power


@pytest.fixture(params=[(2, "verify_k1"), (3, "verify_k2")], ids=["one-row-differs", "two-rows-differ"])
def one_row_differs(quant_target_engine, request):
    """The engine as it runs on a CPU whose one-row MatMulNBits rounds differently (backends/row_probe.py; on this
    stop's AVX2 CPU two or more rows agree: exact_rows 2), or where even two rows differ (exact_rows 3, made up:
    the smallest built k's verify then serves), with the graphs it runs recorded -> (decoder, ran, the verify graph
    its target-only steps should run)."""
    rows, graph = request.param
    t = quant_target_engine.target
    ran, run = [], t._run
    t._exact_rows, t._run = rows, lambda name, *a, **kw: ran.append(name) or run(name, *a, **kw)
    try:
        yield quant_target_engine, ran, graph
    finally:
        t._exact_rows, t._run = None, run


def test_an_engine_with_quantized_target_layers_has_a_2_row_exact_step(quant_target_engine):
    """The build adds verify_k1 (greedy and sampling, with per-row variants) to a quantized fused target although
    k = 1 is not built; steps may use it only where it is the target-only step (exact_rows 2: free_ks)."""
    dec, t = quant_target_engine, quant_target_engine.target
    assert {"verify_k1_greedy", "verify_k1_sample", "verify_k1_greedy_rows2"} <= set(t.graphs)
    assert t.free_ks == ((1,) if t.exact_rows == 2 else ()) and dec.built_ks() == (*t.free_ks, 2)
    try:
        for rows, ks in ((1, (2,)), (2, (1, 2)), (3, (2,))):
            t._exact_rows = rows
            assert dec.built_ks() == ks
    finally:
        t._exact_rows = None


def test_a_free_k1_draft_rides_in_the_target_only_step(quant_target_dir):
    """Where the target-only step is verify_k1 (forced here), k = 1 is a step width: auto and ragged lookup
    proposals of one token run it, and greedy output is target-only's, token for token."""
    dec = SpeculativeDecoder.load(quant_target_dir, backend="onnxruntime", max_batch=4)
    dec.target._exact_rows = 2
    prompts = [[1, 2, 3, 1, 2, 3], [3, 3, 1, 0, 2, 1]]
    base = [o.token_ids for o in dec.generate(prompts, max_new_tokens=8, speculative=False)]
    auto = dec.generate(prompts, max_new_tokens=8, k="auto")
    assert [o.token_ids for o in auto] == base
    assert [dec.generate(p, max_new_tokens=8, k="auto")[0].token_ids for p in prompts] == base
    assert dec.autok().ks == (1, 2)
    assert [o.token_ids for o in dec.generate(prompts, max_new_tokens=8, k=1)] == base  # a fixed k = 1 too
    lookup = SpeculativeDecoder.load(quant_target_dir, backend="onnxruntime", drafter="prompt-lookup")
    t, ran = lookup.target, []
    t._exact_rows, run = 2, t._run
    t._run = lambda name, B, ins, *a, **kw: ran.append((name, int(ins.get("draft_len", [0])[0]))) or run(name, B, ins,
                                                                                                      *a, **kw)
    assert [lookup.generate(p, max_new_tokens=8, k="auto")[0].token_ids for p in prompts] == base
    assert ("verify_k1_greedy", 1) in ran


def test_target_only_steps_run_through_a_verify_where_one_row_rounds_differently(one_row_differs):
    """Greedy: target-only steps are then the narrowest verify with enough rows, with no drafts, and speculative
    output (fixed k and auto, whose target-only steps take this path too) is target-only's, token for token."""
    dec, ran, graph = one_row_differs
    prompts = [[1, 2, 3, 1, 2], [3, 3, 1, 0, 2, 1]]
    base = [dec.generate(p, max_new_tokens=8, speculative=False)[0].token_ids for p in prompts]
    assert ran and all(name.startswith(graph) for name in ran if name.startswith("verify"))
    for k in (2, "auto"):
        assert [dec.generate(p, max_new_tokens=8, k=k)[0].token_ids for p in prompts] == base


def test_sampled_target_only_steps_through_a_verify_keep_the_distribution(small, quant_target_engine,  # noqa: F811
                                                                         one_row_differs):
    """Sampling through that path (the next token drawn from the verify's row 0 with the step's uniform) has the
    engine's own target distribution."""
    dec, ran, graph = one_row_differs
    sp = CASES[0]
    samples = sample(dec, sp, N, batch=1, speculative=False)
    assert f"{graph}_sample" in ran
    assert chi2_pvalue(samples, engine_distribution(dec, sp)) > 1e-3


def test_batch_invariant_steps_never_run_a_lone_row(quant_target_engine):
    """Batch 17 runs in chunks of up to 16 rows (the per-row-attention variants), split 15 + 2, not 16 + 1: a lone
    row's linears would run on one row, and batch-1 output (target-only steps over 2 rows) would differ from it
    where one row rounds differently. Each row's tokens equal its tokens alone."""
    dec, t = quant_target_engine, quant_target_engine.target
    prompts = [[1, 2, 3, 1, 2], [3, 3, 1, 0, 2, 1]] * 8 + [[2, 0, 1]]
    seen, binding = [], t._binding
    t._binding = lambda name, B, row0=0: seen.append((name, B)) or binding(name, B, row0)
    try:
        batched = [o.token_ids for o in dec.generate(prompts, max_new_tokens=4, speculative=False)]
    finally:
        t._binding = binding
    assert {(n, B) for n, B in seen if n.startswith("verify_k0_exact")} == {("verify_k0_exact_greedy_rows15", 15),
                                                                         ("verify_k0_exact_greedy_rows2", 2)}
    assert batched == [dec.generate(p, max_new_tokens=4, speculative=False)[0].token_ids for p in prompts]


def test_the_row_probe_model_is_valid_onnx():
    """The probe model is serialized by hand (the runtime has no onnx package): the checker accepts it, and the
    probe runs on this CPU (either answer is valid here)."""
    import onnx
    import onnxruntime as ort

    from specexport.backends.row_probe import exact_rows, probe_model
    model = onnx.load_from_string(probe_model([(4, 32, 4, 576, True), (8, 16, 4, 64, False)]))
    onnx.checker.check_model(model)
    assert [i.name for i in model.graph.input] == ["x64", "x576", "xb", "xf"]
    layers = {"a": {"bits": 4, "block_size": 32, "accuracy_level": 4, "shape": [8, 576], "symmetric": False}}
    assert exact_rows(ort, layers, 2) in (1, 2, 3) and exact_rows(ort, {}) == 1


def _unpacked_one_row_agrees() -> bool:
    """Built with onnx.helper (not the probe's hand serializer): does an unpacked fp32 FusedMatMul / Gemm give row 0
    of a 1-row pass bit for bit as of a 2- and 9-row pass?"""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(3)
    w, b = rng.standard_normal((200, 128)).astype(np.float32), rng.standard_normal(200).astype(np.float32)
    nodes = [helper.make_node("FusedMatMul", ["x", "w"], ["y"], domain="com.microsoft", transB=1),
             helper.make_node("Gemm", ["x", "w", "b"], ["g"], transB=1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", 128])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "yg"],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_prepacking", "1")
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    x = rng.standard_normal((9, 128)).astype(np.float32)
    out = {m: sess.run(None, {"x": x[:m]}) for m in (1, 2, 9)}
    return all(np.array_equal(out[1][i][0], out[m][i][0]) for i in range(2) for m in (2, 9))


@pytest.mark.parametrize("graph_set", ["fused", "portable"])
def test_an_unpacked_fp32_engine_is_exact_where_one_row_rounds_differently(full_head_engines, portable_engines,
                                                                          graph_set):
    """Without pre-packing MLAS runs a one-row fp32 GEMM through its own kernel (2e-5 apart from 2 and 9 rows on
    this stop's AVX2 CPU), so a 1-token target step could differ from the same position in a verify: the probe
    sees the unpacked linears (its answer equals an independent check), target-only steps then run a verify of
    2 rows on either graph set, and greedy speculative output is target-only's, token for token. (Fused: a
    full-head build; the certified head's MatMulNBits always pre-packs.)"""
    from specexport.backends.ort_engine import OrtEngine
    dec = SpeculativeDecoder.load((full_head_engines if graph_set == "fused" else portable_engines)["llama"],
                                  prepack=False)
    t = dec.target
    assert isinstance(t, OrtEngine) and not t.prepack
    assert t.exact_rows == (1 if _unpacked_one_row_agrees() else 2)
    ran, run = [], t._run
    t._run = lambda name, *a, **kw: ran.append(name) or run(name, *a, **kw)
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 3, 3, 1, 4]]
    base = [dec.generate(p, max_new_tokens=10, speculative=False)[0].token_ids for p in prompts]
    steps = {name for name in ran if name.startswith("verify")}
    assert steps == ({"verify_k1_greedy"} if t.exact_rows == 2 else
                     {"verify_k0_exact_greedy"} if graph_set == "fused" else {"verify_k0_greedy"})
    for k in (1, 3, "auto"):
        assert [dec.generate(p, max_new_tokens=10, k=k)[0].token_ids for p in prompts] == base
    assert [o.token_ids for o in dec.generate(prompts, max_new_tokens=10, k=3)] == base
    assert t.free_ks == ((1,) if t.exact_rows == 2 else ())


def test_an_engine_without_k1_rides_drafts_in_its_wider_exact_step(full_head_engines):
    """An unpacked engine built with k = 3 only, where one row rounds differently: its target-only step is the
    k = 3 verify, so k = 3 costs a target-only step (free_ks) and lookup's proposals ride in it; tokens equal."""
    dec = SpeculativeDecoder.load(full_head_engines["lookup"], prepack=False)
    t = dec.target
    if t.exact_rows == 1:
        pytest.skip("one unpacked fp32 row rounds as among more on this CPU")
    assert t.free_ks == (3,) and dec.built_ks() == (3,)
    ran, run = [], t._run

    def recorded(name, B, ins, *a, **kw):
        ran.append((name, int(ins.get("draft_len", [0])[0])))
        return run(name, B, ins, *a, **kw)
    t._run = recorded
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 3, 3, 1, 4]]
    base = [dec.generate(p, max_new_tokens=12, speculative=False)[0].token_ids for p in prompts]
    assert {name for name, _ in ran} - {"prefill"} == {"verify_k3_greedy"}
    ran.clear()
    assert [dec.generate(p, max_new_tokens=12, k="auto")[0].token_ids for p in prompts] == base
    assert any(n > 0 for name, n in ran if name == "verify_k3_greedy")


def test_a_portable_engine_without_grouped_heads_has_a_2_row_exact_step(tmp_path):
    """The portable set's attention stacks each kv head's query heads as rows; with as many kv heads as heads a
    1-token pass multiplies one row of probabilities by V (MLAS's one-row GEMV: 1.5e-5 from the same row among 2
    on this stop's CPU), so its target-only steps are a 2-row verify, and lookup output is target-only's."""
    from helpers import SHAPES, make_tiny
    make_tiny(tmp_path / "mha", "llama", num_key_value_heads=4)
    out = build(BuildConfig(target=str(tmp_path / "mha"), ks=(1, 3), ops="portable", sampling=False,
                            out=str(tmp_path / "eng"), **SHAPES), progress=False)["out"]
    dec = SpeculativeDecoder.load(out)
    t = dec.target
    assert t.config.num_heads == t.config.num_kv_heads and t.exact_rows >= 2
    assert t.free_ks == (1 if t.exact_rows == 2 else 3,)
    ran, run = [], t._run
    t._run = lambda name, *a, **kw: ran.append(name) or run(name, *a, **kw)
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 3, 3, 1, 4]]
    base = [dec.generate(p, max_new_tokens=10, speculative=False)[0].token_ids for p in prompts]
    assert {name for name in ran if name.startswith("verify")} == {f"verify_k{1 if t.exact_rows == 2 else 3}_greedy"}
    for k in (3, "auto"):
        assert [dec.generate(p, max_new_tokens=10, k=k)[0].token_ids for p in prompts] == base


HANDOVER_PROMPT = [5, 0, 7, 1, 6, 2, 4, 3, 5, 1, 0, 6, 3]  # 12 distinct 2-grams: a model draft often completes one


@pytest.mark.parametrize("k", [2, "auto"])
def test_the_hybrids_handover_keeps_the_target_distribution(small, quant_engine, k):  # noqa: F811
    """The quantized copy runs over the target's cache, so the hybrid's model hands a row over to lookup once its
    drafts complete a match (drafters.HybridDrafter): the rest of the row's q is one-hot. On this prompt a quarter
    to a third of the steps hand over, and the samples keep the target's distribution (3N samples: at k = 2 the
    first N read p = 0.0008 with the handover and 0.0023 without it, the next 2N 0.036 and 0.41: chance; 3N, 0.60).
    A decoder of its own: auto learns over a decoder's life, and the other tests' prompts teach it other choices."""
    dec = SpeculativeDecoder.load(quant_engine.source, backend="onnxruntime")
    assert dec.drafter.shares_kv and dec.drafter.handover
    sp = CASES[0]
    outs = dec.generate([HANDOVER_PROMPT] * 100, NEW, k=k,
                        sampling=[SamplingParams(sp.temperature, seed=i) for i in range(100)])
    steps = sum((Counter(o.stats.steps_by) for o in outs), Counter())
    assert steps["model+lookup"] > 0.15 * sum(steps.values()), steps  # (k = 2: 0.35, auto: 0.25)
    samples = sample(dec, sp, 3 * N, k=k, prompt=HANDOVER_PROMPT)
    assert chi2_pvalue(samples, exact_distribution(small["hf"], sp, HANDOVER_PROMPT)) > 1e-3
