"""Continuous batching in-process: requests join a running batch at step boundaries, in free rows, and get
exactly the tokens they get alone; a full queue makes submitters wait, never fail."""

import threading
import time

import pytest

from specexport import SamplingParams, SpeculativeDecoder, SpecExportError
from specexport.serve.batcher import ContinuousBatcher
from test_runtime_greedy import PROMPTS


@pytest.fixture(scope="module")
def dec(tiny):
    t = tiny["qwen3"]
    return SpeculativeDecoder.from_pretrained(t["target"], t["perturbed"], k=3, max_seq_len=128, max_batch=3,
                                              prefill_chunk=16)


def collect(batcher, jobs):
    """Submit every job from its own thread; returns the tokens and the chunk count of each."""
    out = [None] * len(jobs)
    done = [threading.Event() for _ in jobs]

    def run(i):
        prompt, n, sp, stop = jobs[i]
        toks, chunks = [], []

        def on_chunk(c):
            toks.extend(c.token_ids)
            chunks.append(c)
            if c.finished:
                out[i] = (toks, chunks)
                done[i].set()

        batcher.submit(prompt, on_chunk, max_new_tokens=n, sampling=sp, stop_token_ids=stop)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for i, t in enumerate(threads):
        t.start()
        time.sleep(0.01 * (i % 3))  # staggered: later requests join a batch that is already running
    for e in done:
        assert e.wait(120)
    return out


def test_joined_requests_get_their_solo_tokens(dec):
    batcher = ContinuousBatcher(dec, max_waiting=2)  # 3 rows, a queue of 2: most submitters wait
    try:
        sps = [SamplingParams(), SamplingParams(0.8, top_p=0.9, seed=4), SamplingParams(1.0, top_k=10, seed=9)]
        jobs = [(PROMPTS[i % 3], 6 + 5 * (i % 4), sps[i % 3], ()) for i in range(10)]
        got = collect(batcher, jobs)
        for (prompt, n, sp, _), (toks, chunks) in zip(jobs, got):
            alone = dec.generate(prompt, max_new_tokens=n, sampling=sp)[0]
            assert toks == alone.token_ids
            assert chunks[-1].finished and chunks[-1].stats.new_tokens == n
            assert all(not c.finished for c in chunks[:-1])
        m, stats = batcher.metrics, [chunks[-1].stats for _, chunks in got]
        assert m.value("requests", finish_reason="length") == 10
        assert m.value("generation_tokens") == sum(s.new_tokens for s in stats)
        assert m.value("spec_decode_num_draft_tokens") == sum(s.drafted for s in stats)
        assert m.value("spec_decode_num_accepted_tokens") == sum(s.accepted for s in stats)
        per_pos = [m.value("spec_decode_num_accepted_tokens_per_pos", position=str(i)) for i in (1, 2, 3)]
        assert sum(per_pos) == m.value("spec_decode_num_accepted_tokens") and per_pos == sorted(per_pos)[::-1]
        assert per_pos[0] <= m.value("spec_decode_num_drafts") == sum(sum(s.proposed_hist[1:]) for s in stats)
        assert sum(m.value("steps", k=str(k)) for k in range(4)) == sum(s.steps for s in stats)
        gauges = {x.name: x.value for x in m.samples() if x.kind == "gauge"}
        assert gauges == {"specexport_num_requests_running": 0.0, "specexport_num_requests_waiting": 0.0}
    finally:
        batcher.close()


def test_target_only_batcher_and_bad_requests(dec):
    batcher = ContinuousBatcher(dec, speculative=False)
    try:
        with pytest.raises(SpecExportError, match="max_new_tokens must be >= 1"):
            batcher.submit(PROMPTS[0], lambda c: None, max_new_tokens=0)
        with pytest.raises(SpecExportError, match="outside the vocabulary"):
            batcher.submit([1, 2, 500], lambda c: None)
        (toks, chunks), = collect(batcher, [(PROMPTS[1], 12, SamplingParams(), ())])
        assert toks == dec.generate(PROMPTS[1], 12, speculative=False)[0].token_ids
        assert chunks[-1].stats.drafted == 0
    finally:
        batcher.close()


def test_stop_strings_offline(tiny, tmp_path):
    from helpers import make_tiny, word_tokenizer
    make_tiny(tmp_path / "t", "llama", seed=4, tokenizer=word_tokenizer([f"w{i}" for i in range(96)]),
              logit_scale=4.0, tie_word_embeddings=False)
    d = SpeculativeDecoder.from_pretrained(str(tmp_path / "t"), k=3, max_seq_len=64, max_batch=2)
    ref = d.generate("w1 w2 w3 w1 w2", max_new_tokens=20)[0]
    words = ref.text.split()
    stop = f"{words[4]} {words[5]}"
    cut = ref.text[:ref.text.index(stop)]
    out = d.generate("w1 w2 w3 w1 w2", max_new_tokens=20, stop=[stop])[0]
    assert out.text == cut and out.finish_reason == "stop"
    assert ref.token_ids[:len(out.token_ids)] == out.token_ids and len(out.token_ids) < 20
    shown = "".join(e.text for e in d.stream("w1 w2 w3 w1 w2", max_new_tokens=20, stop=[stop + " w0 w0"]))
    assert shown == ref.text  # never completed: all of it, and nothing held back at the end
    with pytest.raises(SpecExportError, match="stop strings need"):
        d.generate([1, 2], max_new_tokens=4, stop=[""])


def test_close_fails_running_and_queued_requests(dec):
    batcher = ContinuousBatcher(dec, max_waiting=8)
    finals = []
    for i in range(6):
        batcher.submit(PROMPTS[i % 3], lambda c: finals.append(c) if c.finished else None, max_new_tokens=50)
    batcher.close()
    assert len(finals) == 6 and all(c.finished for c in finals)
    assert any(c.error == "the model is shutting down" for c in finals)
    with pytest.raises(SpecExportError, match="stopped|closing"):
        batcher.submit(PROMPTS[0], lambda c: None)


def test_seed_out_of_range_is_refused():
    with pytest.raises(SpecExportError, match=r"seed must be in \[0, 2\*\*63\)"):
        SamplingParams(1.0, seed=2**64)


def test_cancelled_requests_free_their_rows(dec):
    batcher = ContinuousBatcher(dec)  # 3 rows
    try:
        flags = [threading.Event() for _ in range(3)]
        finals, started = {}, threading.Event()

        def on_chunk(i):
            def cb(c):
                started.set()
                if c.finished:
                    finals[i] = c
            return cb

        for i in range(3):  # long requests fill every row; then all are cancelled
            batcher.submit(PROMPTS[0], on_chunk(i), max_new_tokens=100, is_cancelled=flags[i].is_set)
        assert started.wait(30)
        for f in flags:
            f.set()
        deadline = time.time() + 30
        while len(finals) < 3 and time.time() < deadline:
            time.sleep(0.01)
        assert all(finals[i].finish_reason == "cancelled" for i in range(3))
        assert all(finals[i].stats.new_tokens < 100 for i in range(3))
        assert batcher.metrics.value("requests", finish_reason="cancelled") == 3
        (toks, _), = collect(batcher, [(PROMPTS[1], 12, SamplingParams(), ())])  # the rows serve again
        assert toks == dec.generate(PROMPTS[1], 12)[0].token_ids
    finally:
        batcher.close()
