"""Built engines give the same tokens on every backend as the eager torch runtime and transformers."""

import pytest

from helpers import FAMILIES, hf_greedy
from specexport import SamplingParams, SpeculativeDecoder, SpecExportError
from test_runtime_greedy import NEW, PROMPTS

BACKENDS = ("onnxruntime", "torch", "torchscript")


@pytest.fixture(scope="module")
def hf_reference(tiny):
    return {fam: [hf_greedy(tiny[fam]["hf"], p, NEW) for p in PROMPTS] for fam in FAMILIES}


@pytest.mark.parametrize("drafter", ["hybrid", "model"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_engine_equals_transformers_at_every_k(engines, hf_reference, family, backend, drafter):
    dec = SpeculativeDecoder.load(engines[family], backend=backend, drafter=drafter)
    assert dec.target.ks == (1, 3)
    assert [o.token_ids for o in dec.generate(PROMPTS, NEW, speculative=False)] == hf_reference[family]
    for k in (1, 3):
        outs = dec.generate(PROMPTS, NEW, k=k)
        assert [o.token_ids for o in outs] == hf_reference[family], f"k={k}"
        assert 0 < sum(o.stats.accepted for o in outs) < sum(o.stats.drafted for o in outs)  # perturbed draft
        by = {d for o in outs for d in o.stats.drafted_by}  # PROMPTS[1] repeats: the hybrid uses both drafters
        assert by == ({"model", "prompt-lookup"} if drafter == "hybrid" else {"model"}), by


@pytest.mark.parametrize("family", FAMILIES)
def test_both_graph_sets_give_the_same_tokens(engines, portable_engines, hf_reference, family):
    """The fused set (ONNX Runtime's ops) and the portable set (standard ops) pass the same exactness checks,
    greedy and seeded sampling, and the fused graphs have far fewer nodes."""
    import json
    from pathlib import Path
    fused, portable = (SpeculativeDecoder.load(e[family]) for e in (engines, portable_engines))
    sampling = [SamplingParams(0.9, top_k=20, top_p=0.9, seed=5), SamplingParams(), SamplingParams(1.2, seed=6)]
    for dec in (fused, portable):
        assert [o.token_ids for o in dec.generate(PROMPTS, NEW, speculative=False)] == hf_reference[family]
        for k in (1, 3, "auto"):
            assert [o.token_ids for o in dec.generate(PROMPTS, NEW, k=k)] == hf_reference[family], k
    for k in (1, 3):
        a, b = ([o.token_ids for o in d.generate(PROMPTS, NEW, sampling=sampling, k=k)] for d in (fused, portable))
        assert a == b, k
    fused_n, portable_n = (json.loads((Path(e[family]) / "manifest.json").read_text())["models"]["target"]
                           ["graphs"]["verify_k3_greedy"]["nodes"] for e in (engines, portable_engines))
    assert fused_n < 0.5 * portable_n, (fused_n, portable_n)


def test_fused_graphs_name_no_unread_outputs(engines):
    """SkipSimplifiedLayerNormalization's training outputs (mean, inverse std) are left unnamed, so ONNX Runtime
    does not write them on every step."""
    import onnx
    from pathlib import Path
    for f in sorted((Path(engines["llama"]) / "target").glob("*.onnx")):
        g = onnx.load(str(f), load_external_data=False).graph
        skip = [n for n in g.node if n.op_type == "SkipSimplifiedLayerNormalization"]
        assert skip, f.name
        assert all(list(n.output[1:3]) == ["", ""] and n.output[0] and n.output[3] for n in skip), f.name


@pytest.mark.parametrize("backend", BACKENDS)
def test_prompt_lookup_engine(engines, hf_reference, backend):
    if backend == "torchscript":
        with pytest.raises(SpecExportError, match="no TorchScript"):
            SpeculativeDecoder.load(engines["lookup"], backend=backend)
        return
    dec = SpeculativeDecoder.load(engines["lookup"], backend=backend)
    assert dec.drafter.name == "prompt-lookup"
    assert [o.token_ids for o in dec.generate(PROMPTS, NEW)] == hf_reference["llama"]
    with pytest.raises(SpecExportError, match="built with --greedy-only"):
        dec.generate(PROMPTS[0], 4, sampling=SamplingParams(1.0))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_same_seed_same_tokens_on_torch_and_onnxruntime(engines, family):
    decs = {b: SpeculativeDecoder.load(engines[family], backend=b) for b in BACKENDS}
    sampling = [SamplingParams(0.9, top_k=20, top_p=0.9, seed=5), SamplingParams(), SamplingParams(1.2, seed=6)]
    for k, speculative in ((1, True), (3, True), (3, False)):
        got = {b: [o.token_ids for o in d.generate(PROMPTS, NEW, sampling=sampling, k=k, speculative=speculative)]
               for b, d in decs.items()}
        assert got["onnxruntime"] == got["torch"] == got["torchscript"], (k, speculative)
        again = [o.token_ids for o in decs["onnxruntime"].generate(PROMPTS, NEW, sampling=sampling, k=k,
                                                                   speculative=speculative)]
        assert again == got["onnxruntime"]
    other = [SamplingParams(0.9, top_k=20, top_p=0.9, seed=50), SamplingParams(), SamplingParams(1.2, seed=60)]
    moved = [o.token_ids for o in decs["onnxruntime"].generate(PROMPTS, NEW, sampling=other, k=3)]
    assert moved[0] != got["onnxruntime"][0] and moved[1] == got["onnxruntime"][1]


def test_engine_streams_and_batches_like_the_eager_runtime(engines, tiny):
    eager = SpeculativeDecoder.from_pretrained(tiny["mistral"]["target"], tiny["mistral"]["perturbed"], k=3,
                                               max_seq_len=128, max_batch=4, prefill_chunk=16)
    dec = SpeculativeDecoder.load(engines["mistral"])
    ref = [o.token_ids for o in eager.generate(PROMPTS, NEW)]
    streamed = {i: [] for i in range(len(PROMPTS))}
    for ev in dec.stream(PROMPTS, NEW):
        streamed[ev.index] += ev.token_ids
    assert [streamed[i] for i in range(len(PROMPTS))] == ref
    assert [dec.generate([p], NEW)[0].token_ids for p in PROMPTS] == ref  # batch 1 uses its own bindings


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_batched_verify_runs_attention_per_row(engines, portable_engines, hf_reference, family, monkeypatch,
                                                tmp_path):
    """A fused target has per-row-attention variants of its multi-token verify graphs and its exact
    target-only step for batches 2..max_batch: one call runs the linears over every row and attention per row
    (ONNX Runtime's GroupQueryAttention refuses multi-token rows with a past at batch > 1; without them a verify
    ran the whole graph once per row). A batched verify gives each row's batch-1 bits; with batch_invariant
    the batched target-only steps do too (by default they are the batched one-token graph, which can round
    differently after a near tie), so a batch gives each row's batch-1 tokens at every k, auto included, and
    the same tokens as the row-by-row calls of an engine without the variants."""
    import json
    from pathlib import Path
    m = json.loads((Path(engines[family]) / "manifest.json").read_text())
    graphs, L = m["models"]["target"]["graphs"], m["models"]["target"]["config"]["num_layers"]
    assert {n for n in graphs if "_rows" in n} == {f"{g}_{mode}_rows{B}" for g in ("verify_k1", "verify_k3",
                                                                                  "verify_k0_exact")
                                                   for mode in ("greedy", "sample") for B in (2, 3, 4)}
    g = graphs["verify_k3_greedy_rows3"]
    assert g["of"] == "verify_k3_greedy" and g["rows"] == 3 and "inputs" not in g  # (its graph's, listed there)
    assert g["op_counts"]["GroupQueryAttention"] == 3 * L
    import onnx
    proto = onnx.load(str(Path(engines[family]) / g["file"]), load_external_data=False)
    caches = [i for i in proto.graph.input if i.name.startswith(("key.", "value."))]
    assert [c.name for c in caches[:3]] == ["key.0.0", "key.0.1", "key.0.2"] and len(caches) == 2 * L * 3
    assert all(c.type.tensor_type.shape.dim[0].dim_value == 1 for c in caches)
    assert [d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim] == [3, 4]
    assert "verify_k3_greedy_rows3" not in json.dumps(m["models"].get("draft", {}))  # (the target's only)

    assert not SpeculativeDecoder.load(engines[family]).target.batch_invariant  # (the default)
    dec = SpeculativeDecoder.load(engines[family], drafter="hybrid", batch_invariant=True)
    assert dec.target.per_row and not dec.target.row_by_row
    one = {k: [dec.generate([p], NEW, k=k or None, speculative=k != 0)[0].token_ids for p in PROMPTS]
           for k in (0, 1, 3, "auto")}
    assert one[0] == hf_reference[family]
    for k, want in one.items():
        assert [o.token_ids for o in dec.generate(PROMPTS, NEW, k=k or None, speculative=k != 0)] == want, k
    B = len(PROMPTS)
    assert {f"verify_k3_greedy_rows{B}", f"verify_k0_exact_greedy_rows{B}"} <= set(dec.target._sessions)
    from specexport.backends import ort_engine
    monkeypatch.setattr(ort_engine, "PER_ROW_MAX", 2)  # a batch over the largest variant: chunks (2 + 1 rows)
    for k in (0, 3):
        assert [o.token_ids for o in dec.generate(PROMPTS, NEW, k=k or None, speculative=k != 0)] == one[k], k
    SpeculativeDecoder.load(portable_engines[family], batch_invariant=True)  # (standard ops: nothing to do)
    import shutil
    old = tmp_path / "engine"  # an engine built before the variants
    shutil.copytree(engines[family], old)
    m["models"]["target"]["graphs"] = {n: g for n, g in graphs.items() if "_rows" not in n}
    (old / "manifest.json").write_text(json.dumps(m))
    assert [o.token_ids for o in SpeculativeDecoder.load(str(old)).generate(PROMPTS, NEW, k=3)] == one[3]
    with pytest.raises(SpecExportError, match="batch_invariant=True needs the per-row-attention graphs"):
        SpeculativeDecoder.load(str(old), batch_invariant=True)


def test_k_must_be_built(engines):
    dec = SpeculativeDecoder.load(engines["qwen2"])
    with pytest.raises(SpecExportError, match=r"k=2 has no graphs in this engine \(built: 1, 3\)"):
        dec.generate(PROMPTS[0], 4, k=2)
    with pytest.raises(SpecExportError, match="max_batch=9 exceeds"):
        SpeculativeDecoder.load(engines["qwen2"], max_batch=9)


@pytest.mark.parametrize("graphs", ["fused", "portable", "torchscript"])
def test_draft_catch_up_by_draft_calls_equals_by_prefill_chunks(engines, portable_engines, hf_reference, graphs):
    """A draft model that missed target-only steps catches up through draft calls (two tokens each; the fused
    set chains one-token passes, a graph per k drafts its smallest built k, here 3, whose extra writes are
    overwritten) or through prefill chunks: both write the draft's cache of the committed tokens, so about
    as many drafts are accepted (the graphs round differently, so a near tie may go either way), and the
    tokens stay the target's."""
    folder = (portable_engines if graphs == "portable" else engines)["llama"]
    dec = SpeculativeDecoder.load(folder, backend="torchscript" if graphs == "torchscript" else "onnxruntime",
                                  drafter="model")
    if graphs != "fused":
        dec.drafter.engine.ks = (3,)  # (the draft_k3 graph)
    runs = []
    for by in ("chunk", "pass"):
        seq = iter([0, 0, 0, 3, 0, 1, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 1, 3] * 10)
        dec.autok().plan = lambda B, rows, missing=0, free=None: next(seq)
        dec.autok().catch_up = lambda gap, B, by=by: (0.0, by)
        outs = dec.generate(PROMPTS, NEW, k="auto")
        assert [o.token_ids for o in outs] == hf_reference["llama"], by
        runs.append((sum(o.stats.drafted for o in outs), sum(o.stats.accepted for o in outs)))
    (drafted_c, accepted_c), (drafted_p, accepted_p) = runs
    assert drafted_c > 0 and drafted_p > 0 and accepted_c > 0
    assert abs(accepted_p / drafted_p - accepted_c / drafted_c) <= 0.1, runs


@pytest.mark.parametrize("family", FAMILIES)
def test_the_certified_head_gives_the_full_heads_tokens(engines, tiny, hf_reference, family, tmp_path):
    """The fused greedy graphs' certified argmax (models/certified.py) against the same engine built with
    `--target-head full`: the same tokens target-only, at every k and at auto, equal to transformers. The If that
    falls back to the full head is in every greedy verify graph and in no sampling one."""
    import json
    from pathlib import Path
    from helpers import SHAPES
    from specexport.config import BuildConfig
    from specexport.export.build import build
    full = build(BuildConfig(target=tiny[family]["target"], draft=tiny[family]["perturbed"], ks=(1, 3),
                             target_head="full", out=str(tmp_path / "full"), **SHAPES), progress=False)["out"]
    manifests = [json.loads((Path(e) / "manifest.json").read_text())["models"]["target"]
                 for e in (engines[family], full)]
    assert manifests[0]["certified_head"] == {"bits": 8, "block": 32, "top": 16, "safety": 1.25}
    assert "certified_head" not in manifests[1]
    for name, g in manifests[0]["graphs"].items():
        assert ("If" in g["op_counts"]) == (name.startswith("verify") and "greedy" in name), name
    assert not any("If" in g["op_counts"] for g in manifests[1]["graphs"].values())
    for e in (engines[family], full):
        dec = SpeculativeDecoder.load(e)
        assert [o.token_ids for o in dec.generate(PROMPTS, NEW, speculative=False)] == hf_reference[family]
        for k in (1, 3, "auto"):
            assert [o.token_ids for o in dec.generate(PROMPTS, NEW, k=k)] == hf_reference[family], k
