"""Sampling is exact in distribution, and seeded.

On a tiny vocabulary (V=8) the exact distribution of 3-token continuations is enumerated from the target
with transformers' own logits warpers, and compared with speculative samples by a chi-square test.
Seeds are fixed, so the test is deterministic. A negative control checks that the test has power.
"""

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from helpers import make_tiny
from specexport import SamplingParams, SpeculativeDecoder

V, NEW, N = 8, 3, 10000
PROMPT = [1, 2, 3, 1, 2]  # repeats, so prompt lookup proposes something
SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
ENGINE_SHAPES = dict(ks=(2,), max_seq_len=16, max_batch=100, prefill_chunk=8)  # engines for the enumeration


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("small")
    kw = dict(SMALL, num_hidden_layers=1)
    target = make_tiny(root / "target", "qwen2", seed=1, logit_scale=6.0, **kw)
    draft = make_tiny(root / "draft", "qwen2", seed=1, logit_scale=3.0, perturb_from=target, perturb=0.3, **kw)
    return dict(target=str(root / "target"), draft=str(root / "draft"), hf=target, hf_draft=draft)


def exact_distribution(hf, sp: SamplingParams, prompt: list[int] = PROMPT) -> dict[tuple, float]:
    """P(x1 x2 x3 | prompt) under processed p, by enumeration."""
    from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    procs = LogitsProcessorList([TemperatureLogitsWarper(sp.temperature)]
                                + ([TopKLogitsWarper(sp.top_k)] if sp.top_k else [])
                                + ([TopPLogitsWarper(sp.top_p)] if sp.top_p < 1 else []))
    probs = {}
    with torch.no_grad():
        for prefix_len in range(NEW):
            prefixes = list(itertools.product(range(V), repeat=prefix_len))
            ids = torch.tensor([prompt + list(pre) for pre in prefixes])
            p = procs(None, hf(ids).logits[:, -1]).softmax(-1)
            for pre, row in zip(prefixes, p):
                for t in range(V):
                    probs[pre + (t,)] = probs.get(pre, 1.0) * float(row[t])
    return {s: v for s, v in probs.items() if len(s) == NEW}


def sample(dec, sp: SamplingParams, n: int, batch: int = 100, prompt: list[int] = PROMPT, **generate_kw) -> list[tuple]:
    """n sampled continuations of prompt, seeds 0..n-1 (generate_kw: speculative=, k=, ...)."""
    out = []
    for start in range(0, n, batch):
        params = [SamplingParams(sp.temperature, sp.top_k, sp.top_p, seed=start + i) for i in range(batch)]
        out += [tuple(o.token_ids) for o in dec.generate([prompt] * batch, max_new_tokens=NEW, sampling=params,
                                                         **generate_kw)]
    return out


def chi2_pvalue(samples: list[tuple], exact: dict[tuple, float]) -> float:
    seqs = sorted(exact)
    expected = np.array([exact[s] for s in seqs]) * len(samples)
    counts = {s: 0 for s in seqs}
    for s in samples:
        counts[s] += 1
    observed = np.array([counts[s] for s in seqs], dtype=float)
    big = expected >= 5  # pool the rare sequences into one bin
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


CASES = [SamplingParams(1.0), SamplingParams(0.7, top_k=4), SamplingParams(1.3, top_p=0.8),
         SamplingParams(0.9, top_k=5, top_p=0.9)]


def draft_spec(small, drafter: str) -> str:
    return {"model": small["draft"], "hybrid": "prompt-lookup+" + small["draft"]}.get(drafter, drafter)


@pytest.mark.parametrize("drafter", ["model", "prompt-lookup", "hybrid"])
@pytest.mark.parametrize("sp", CASES, ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_speculative_samples_have_the_target_distribution(small, sp, drafter):
    dec = SpeculativeDecoder.from_pretrained(small["target"], draft_spec(small, drafter), k=2, max_seq_len=16,
                                             max_batch=100)
    samples = sample(dec, sp, N)
    stats_probe = dec.generate([PROMPT], max_new_tokens=NEW, sampling=sp)[0].stats
    assert stats_probe.steps >= 1
    assert chi2_pvalue(samples, exact_distribution(small["hf"], sp)) > 1e-3
    if drafter == "model" and sp.top_k == 0 and sp.top_p == 1.0:
        # power: the same samples are clearly not from the draft's distribution
        assert chi2_pvalue(samples, exact_distribution(small["hf_draft"], sp)) < 1e-6


@pytest.mark.parametrize("drafter", ["model", "prompt-lookup", "hybrid"])
def test_auto_k_samples_have_the_target_distribution(small, drafter):
    """k="auto": widths chosen per step (lookup: after seeing the proposals, shadow checks at target-only
    steps; a model: probes) leave the distribution exactly the target's."""
    dec = SpeculativeDecoder.from_pretrained(small["target"], draft_spec(small, drafter), k=2, max_seq_len=16,
                                             max_batch=100)
    sp = CASES[0]
    samples = sample(dec, sp, N, k="auto")
    assert chi2_pvalue(samples, exact_distribution(small["hf"], sp)) > 1e-3


def test_target_only_sampling_has_the_target_distribution(small):
    dec = SpeculativeDecoder.from_pretrained(small["target"], small["draft"], k=2, max_seq_len=16, max_batch=100)
    sp = CASES[3]
    samples = []
    for start in range(0, N, 100):
        params = [SamplingParams(sp.temperature, sp.top_k, sp.top_p, seed=start + i) for i in range(100)]
        samples += [tuple(o.token_ids) for o in dec.generate([PROMPT] * 100, max_new_tokens=NEW, sampling=params,
                                                             speculative=False)]
    assert chi2_pvalue(samples, exact_distribution(small["hf"], sp)) > 1e-3


@pytest.fixture(scope="module")
def seeded(tiny):
    t = tiny["llama"]
    return SpeculativeDecoder.from_pretrained(t["target"], t["perturbed"], k=3, max_seq_len=128, max_batch=4)


@pytest.mark.parametrize("speculative", [True, False])
def test_same_seed_same_tokens_other_seed_other_tokens(seeded, speculative):
    prompt = [3, 14, 15, 92, 65]
    run = lambda seed: seeded.generate(prompt, max_new_tokens=32, speculative=speculative,  # noqa: E731
                                       sampling=SamplingParams(1.0, seed=seed))[0].token_ids
    a, b, c = run(7), run(7), run(8)
    assert a == b and a != c


def test_seeded_row_is_independent_of_its_batch(seeded):
    prompt = [3, 14, 15, 92, 65]
    sp = SamplingParams(0.8, top_p=0.95, seed=11)
    alone = seeded.generate(prompt, max_new_tokens=24, sampling=sp)[0].token_ids
    mixed = seeded.generate([[1, 2, 3], prompt, [9] * 20], max_new_tokens=24,
                            sampling=[SamplingParams(), sp, SamplingParams(1.0, seed=3)])
    assert mixed[1].token_ids == alone
    # the greedy row in a mixed batch is still the greedy output
    assert mixed[0].token_ids == seeded.generate([1, 2, 3], max_new_tokens=24)[0].token_ids
