"""CUDA-graph capture (backends/cuda_graphs.py). On CPU the capture logic runs through FakeRuntime with the
harness checks on (static buffers only, storage kept across replays, poisoned caller inputs); the `gpu` tests
run the real torch.cuda.CUDAGraph capture and are skipped without CUDA. What only a GPU shows is listed in the
module's docstring."""

import copy

import numpy as np
import pytest
import torch

from specexport import SamplingParams, SpeculativeDecoder
from specexport.backends import cuda_graphs as cg
from specexport.backends.torch_engine import TorchEngine
from specexport.config import DecoderConfig
from specexport.drafters import ModelDrafter, PromptLookupDrafter
from specexport.errors import SpecExportError
from specexport.models import ModelConfig
from specexport.models.decoder import random_decoder
from test_runtime_sampling import (CASES, N as N_SAMPLES, V, chi2_pvalue, exact_distribution, sample,  # noqa: F401
                                   small)  # (small: a fixture)

CFG = ModelConfig("llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16)
DC = DecoderConfig(k=3, max_seq_len=96, max_batch=4, prefill_chunk=16)
PROMPTS = [[5, 17, 3, 88, 41], [7] * 3 + list(range(20, 34)), [9, 8, 7, 9, 8, 7, 9, 8]]
NEW = 24


@pytest.fixture(scope="module")
def models():
    target = random_decoder(CFG, DC.cache_len, seed=1, logit_scale=4.0)
    return target, random_decoder(CFG, DC.cache_len, seed=2, like=target, noise=0.003)


def decoder(models, drafter: str, runtime=None, device="cpu", **options) -> SpeculativeDecoder:
    """Target (+ draft model) engines on `device`; runtime: capture their draft/verify steps with it."""
    target, draft = models if device == "cpu" else (copy.deepcopy(m).to(device) for m in models)

    def engine(model, vocab=None, role="target"):
        eng = TorchEngine(model, DC.max_batch, DC.cache_len, target_vocab=vocab)
        return eng if runtime is None else eng.capture_steps(runtime(), role=role, **options)
    d = ModelDrafter(engine(draft, CFG.vocab_size, "draft"), "draft") if drafter == "model" else \
        PromptLookupDrafter(1, 3)
    return SpeculativeDecoder(engine(target), d, DC)


def tokens(dec, prompts=PROMPTS, **kw):
    return [o.token_ids for o in dec.generate(prompts, NEW, **kw)]


@pytest.mark.parametrize("drafter", ["prompt-lookup", "model"])
def test_replayed_greedy_equals_eager(models, drafter):
    want = tokens(decoder(models, drafter), speculative=False)
    dec = decoder(models, drafter, cg.FakeRuntime, check=True)
    assert tokens(dec, speculative=False) == want
    outs = dec.generate(PROMPTS, NEW)
    assert [o.token_ids for o in outs] == want
    assert sum(o.stats.accepted for o in outs) > 0
    assert [tokens(dec, [p])[0] for p in PROMPTS] == want  # batch 1 (its own bucket)
    g = dec.target.graphs
    assert {1, 4} <= {key[1] for key in g.graphs}  # 3 rows run the 4-row bucket; the rows past 3 are padding
    assert g.rt.captures == len(g.graphs) and g.rt.replays > g.rt.captures  # each captured once, then replayed
    assert all(key[0].startswith("verify") for key in g.graphs)  # prefill stays eager


def test_sampling_with_host_uniforms_same_tokens_as_eager(models):
    """Host uniforms (the default, CudaRuntime's too): seed for seed, the eager engine's tokens (both drafters)."""
    assert not cg.CudaRuntime.device_uniforms and not cg.FakeRuntime().device_uniforms
    sp = [SamplingParams(temperature=0.8, top_k=20, seed=s) for s in (3, 4, 5)]
    for drafter in ("prompt-lookup", "model"):
        want = tokens(decoder(models, drafter), sampling=sp)
        assert tokens(decoder(models, drafter, cg.FakeRuntime, check=True), sampling=sp) == want


def test_device_uniforms_advance_between_replays():
    """Uniforms drawn by the captured callable from the (registered) generator: a new draw on every replay,
    into the same storage; the host's u is ignored."""
    seen = []

    def step(u, *kv):  # a step that returns its uniforms (plus the caches, as the real steps do)
        seen.append(u.data_ptr())
        return (u * 1.0, *kv)
    graphs = cg.StepGraphs(cg.FakeRuntime(device_uniforms=True), max_batch=2, seed=7, check=True)
    kv = [torch.zeros(2, 1, 4, 2)]
    host_u = torch.zeros(2, 3)
    a = graphs.run("g", ["u"], step, [host_u], lambda Bb: [t[:Bb] for t in kv], 1)[0].copy()
    b = graphs.run("g", ["u"], step, [host_u], lambda Bb: [t[:Bb] for t in kv], 1)[0].copy()
    assert a.shape == (2, 3) and not np.array_equal(a, b) and (a > 0).all() and (a < 1).all()
    assert len(set(seen)) == 1  # every run read the same static u


def test_engine_roles_draw_independent_uniform_streams(models):
    """Two engines seeded alike draw the same uniforms: the draft's u (which picks its tokens) would be the
    verify's u (which accepts them). Each role has its own stream, and a pair sharing one is refused."""
    seeds = {cg.stream_seed(s, r) for s in range(50) for r in cg.STREAMS}
    assert len(seeds) == 50 * len(cg.STREAMS)
    dec = decoder(models, "model", lambda: cg.FakeRuntime(device_uniforms=True), seed=4)
    assert dec.target.graphs.generator_seed != dec.drafter.engine.graphs.generator_seed
    target, draft = (TorchEngine(m, DC.max_batch, DC.cache_len).capture_steps(cg.FakeRuntime(device_uniforms=True))
                     for m in models)
    with pytest.raises(SpecExportError, match="same uniforms"):
        SpeculativeDecoder(target, ModelDrafter(draft, "draft"), DC)


SMALL_DC = DecoderConfig(k=2, max_seq_len=16, max_batch=100, prefill_chunk=8)


@pytest.fixture(scope="module")
def small_engines(small):
    """test_runtime_sampling's V=8 target and draft as fused decoders (for the chi-square test)."""
    from specexport.models.loading import load_model
    return tuple(load_model(small[role], "fp32", SMALL_DC.cache_len).model for role in ("target", "draft"))


def sample_with_device_uniforms(small_engines, runtime, device: str, batch: int, n: int, sp,
                                shared_stream: bool = False) -> list[tuple]:
    """n samples, `batch` rows per generate call. shared_stream: both engines draw the target's stream (the
    seeding before stop 42), captured after the decoder is made so that its check does not refuse them."""
    target, draft = (copy.deepcopy(m).to(device) for m in small_engines)
    eng = [TorchEngine(m, SMALL_DC.max_batch, SMALL_DC.cache_len, target_vocab=v) for m, v in ((target, None),
                                                                                                (draft, V))]
    def capture():
        for e, role in zip(eng, ("target", "target" if shared_stream else "draft")):
            e.capture_steps(runtime(), role=role, seed=3, device_uniforms=True)
    if not shared_stream:
        capture()
    dec = SpeculativeDecoder(eng[0], ModelDrafter(eng[1], "draft"), SMALL_DC)
    if shared_stream:
        capture()
    return sample(dec, sp, n, batch=batch)


@pytest.mark.parametrize("sp", CASES[::3], ids=["T1", "T0.9-k5-p0.9"])
def test_device_uniforms_sample_the_target_distribution(small, small_engines, sp):
    """Uniforms drawn inside the captured steps (the CUDA path's, here under FakeRuntime with a CPU generator):
    10,000 speculative samples against the target's enumerated distribution (test_runtime_sampling's chi-square)."""
    samples = sample_with_device_uniforms(small_engines, lambda: cg.FakeRuntime(device_uniforms=True), "cpu", 100,
                                          N_SAMPLES, sp)
    assert chi2_pvalue(samples, exact_distribution(small["hf"], sp)) > 1e-3


def test_check_catches_a_callable_bound_outside_the_static_buffers(models, monkeypatch):
    """The harness is not vacuous: a capture that binds the caller's tensors instead of its static copies fails."""
    monkeypatch.setattr(cg.StepGraph, "_bound", lambda self, inputs: list(inputs))
    dec = decoder(models, "prompt-lookup", cg.FakeRuntime, check=True)
    with pytest.raises(AssertionError, match="outside the static buffers"):
        dec.generate(PROMPTS, NEW)


def test_outputs_keep_their_storage(models):
    dec = decoder(models, "model", cg.FakeRuntime, check=True)
    tokens(dec)
    before = {key: [o.data_ptr() for o in g.outputs] for key, g in dec.target.graphs.graphs.items()}
    tokens(dec)
    assert {key: [o.data_ptr() for o in g.outputs] for key, g in dec.target.graphs.graphs.items()
            if key in before} == before


def test_buckets():
    assert cg.batch_buckets(8) == (1, 2, 4, 8) and cg.batch_buckets(6) == (1, 2, 4, 6) and cg.batch_buckets(1) == (1,)
    g = cg.StepGraphs(cg.FakeRuntime(), 6)
    assert [g.bucket(b) for b in (1, 2, 3, 5, 6)] == [1, 2, 4, 6, 6]
    with pytest.raises(ValueError):
        g.bucket(7)


def test_capture_needs_cuda_engine(models):
    with pytest.raises(SpecExportError, match="CUDA"):
        TorchEngine(models[0], 2, DC.cache_len).capture_steps()


# ---- on a GPU: the real capture ------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("drafter", ["prompt-lookup", "model"])
def test_cuda_graphs_greedy_equals_eager_cuda(models, drafter):
    """Real capture and replay (with the harness checks: poisoned inputs, storage kept) give the eager CUDA
    engine's greedy tokens, speculative or not."""
    want = tokens(decoder(models, drafter, device="cuda"), speculative=False)
    dec = decoder(models, drafter, cg.CudaRuntime, device="cuda", check=True)
    assert tokens(dec, speculative=False) == want
    assert tokens(dec) == want
    assert all(key[0].startswith("verify") for key in dec.target.graphs.graphs)


@pytest.mark.gpu
def test_cuda_generator_advances_between_replays():
    """Device uniforms (asked for): a new draw on every replay. Host uniforms (the default): the host's u."""
    def step(u, *kv):
        return (u * 1.0, *kv)
    kv = [torch.zeros(2, 1, 4, 2, device="cuda")]
    host_u = torch.full((2, 3), 0.25)
    runs = {}
    for device_uniforms in (True, False):
        graphs = cg.StepGraphs(cg.CudaRuntime("cuda"), max_batch=2, seed=7, device_uniforms=device_uniforms)
        runs[device_uniforms] = [graphs.run("g", ["u"], step, [host_u], lambda Bb: [t[:Bb] for t in kv], 1)[0].copy()
                                 for _ in range(2)]
    a, b = runs[True]
    assert not np.array_equal(a, b) and (a >= 0).all() and (a < 1).all()
    assert all(np.array_equal(u, host_u.numpy()) for u in runs[False])


@pytest.mark.gpu
def test_cuda_sampling_runs_with_device_uniforms(models):
    """Sampling under real capture draws u on the device: tokens are valid and reproducible for the same
    engine seed (not equal to the host-uniform path's: a different random stream)."""
    sp = SamplingParams(temperature=0.8, top_k=20, seed=3)
    a, b = (tokens(decoder(models, "model", cg.CudaRuntime, device="cuda", seed=11, device_uniforms=True), sampling=sp)
            for _ in range(2))
    assert a == b and all(len(t) == NEW and all(0 <= x < CFG.vocab_size for x in t) for t in a)


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", ["prompt-lookup", "model"])
def test_cuda_graphs_sample_each_requests_own_seed(models, drafter):
    """By default the replayed steps take the host's uniforms: each request's seed gives the eager CUDA engine's
    tokens, on every call and in any batch (not run on a GPU yet: written after stop 42's device time)."""
    sp = [SamplingParams(temperature=0.8, top_k=20, seed=s) for s in (3, 4, 5)]
    want = tokens(decoder(models, drafter, device="cuda"), sampling=sp)
    dec = decoder(models, drafter, cg.CudaRuntime, device="cuda")
    assert dec.target.graphs.generator is None
    assert drafter != "model" or dec.drafter.engine.graphs.generator is None
    assert tokens(dec, sampling=sp) == want and tokens(dec, sampling=sp) == want
    assert tokens(dec, PROMPTS[1:2], sampling=sp[1]) == want[1:2]  # alone: the same tokens as in the batch


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 100])
def test_cuda_device_uniforms_sample_the_target_distribution(small, small_engines, batch):
    """Real capture, uniforms from the registered device generators: the target's distribution, at batch 1 too
    (where a draft sharing the target's stream would test each draft token with the u that chose it)."""
    sp = CASES[0]
    samples = sample_with_device_uniforms(small_engines, cg.CudaRuntime, "cuda", batch, N_SAMPLES, sp)
    assert chi2_pvalue(samples, exact_distribution(small["hf"], sp)) > 1e-3


@pytest.mark.gpu
def test_cuda_shared_uniform_stream_fails_the_chi_square(small, small_engines):
    """The negative control: a draft drawing the target's stream (same seed; Philox then gives the draft's u and
    the verify's u at the same flat positions and offsets) is biased at batch 1. Stop 42's H200 run of this setup
    as a script, with 5,000 samples: p = 1.4e-5 shared, 0.94 with separate streams. It depends on both graphs
    advancing their Philox offsets alike; test_engine_roles_draw_independent_uniform_streams guards the fix."""
    sp = CASES[0]
    samples = sample_with_device_uniforms(small_engines, cg.CudaRuntime, "cuda", 1, N_SAMPLES, sp, shared_stream=True)
    assert chi2_pvalue(samples, exact_distribution(small["hf"], sp)) < 1e-3


@pytest.mark.gpu
def test_load_torch_backend_on_cuda_uses_graphs(engines):
    """An engine folder on the torch backend with device='cuda': draft and verify captured, greedy tokens those of
    the same engine on the CPU."""
    from test_runtime_greedy import NEW as N, PROMPTS as P
    want = [o.token_ids for o in SpeculativeDecoder.load(engines["llama"], backend="torch").generate(P, N)]
    dec = SpeculativeDecoder.load(engines["llama"], backend="torch", device="cuda")
    assert dec.target.graphs is not None and dec.drafter.model.engine.graphs is not None
    assert [o.token_ids for o in dec.generate(P, N)] == want
    eager = SpeculativeDecoder.load(engines["llama"], backend="torch", device="cuda", cuda_graphs=False)
    assert eager.target.graphs is None
