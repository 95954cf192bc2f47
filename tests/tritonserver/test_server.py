"""The real tritonserver serving the specexport model: same tokens as the offline runtime, streaming,
16 concurrent clients with continuous batching, bad requests answered with errors, metrics."""

import json
import threading
import urllib.request

import numpy as np
import pytest

from specexport import SamplingParams, SpeculativeDecoder
from specexport.triton.client import generate

PROMPTS = ["w3 w4 w5 w3 w4", "w10 w11 w12 w13 w14 w15 w16 w10 w11 w12", "w7", " ".join(f"w{i % 40}" for i in range(50))]


@pytest.fixture(scope="module")
def offline(texty_engine):
    return SpeculativeDecoder.load(texty_engine, backend="onnxruntime", threads=1)


def call(server, prompt=None, model="specexport", **params):
    return generate(server.grpc_url, model, prompt, timeout=120, **params)


def test_greedy_text_and_ids_equal_the_offline_runtime(server, offline):
    for p in PROMPTS:
        ref = offline.generate(p, max_new_tokens=20)[0]
        r = call(server, p, max_tokens=20)
        assert r.error is None, r.error
        assert r.token_ids == ref.token_ids and r.text == ref.text
        assert r.chunks == 1  # not streamed: one response
        ids = offline.encode(p)
        r2 = call(server, ids, max_tokens=20)
        assert r2.token_ids == ref.token_ids
        st = r.stats
        assert st["finish_reason"] == ref.finish_reason and st["completion_tokens"] == 20
        assert st["drafted"] == ref.stats.drafted and st["accepted"] == ref.stats.accepted
        assert st["acceptance_rate"] == pytest.approx(ref.stats.acceptance_rate)
        assert st["mean_tokens_per_step"] == pytest.approx(ref.stats.mean_committed_per_step)
    chat = call(server, "w5 w6", max_tokens=8, chat=True)
    assert chat.token_ids == offline.generate("w5 w6", max_new_tokens=8, chat=True)[0].token_ids
    target_only = call(server, PROMPTS[1], model="target_only", max_tokens=20)
    assert target_only.token_ids == offline.generate(PROMPTS[1], 20)[0].token_ids
    assert target_only.stats["drafted"] == 0
    auto = call(server, PROMPTS[1], model="auto", max_tokens=20)  # the default k=auto: the same tokens
    assert auto.error is None and auto.token_ids == offline.generate(PROMPTS[1], 20)[0].token_ids


def test_streaming_gives_the_same_tokens(server):
    for p in PROMPTS:
        whole = call(server, p, max_tokens=24)
        streamed = call(server, p, max_tokens=24, stream=True)
        assert streamed.error is None
        assert streamed.token_ids == whole.token_ids and streamed.text == whole.text
        assert streamed.chunks > 1 and streamed.stats == whole.stats


def test_sampling_through_the_server_is_seeded(server, offline):
    sp = SamplingParams(0.9, top_k=30, top_p=0.9, seed=1234)
    ref = offline.generate(PROMPTS[0], max_new_tokens=16, sampling=sp)[0].token_ids
    got = call(server, PROMPTS[0], max_tokens=16, temperature=0.9, top_k=30, top_p=0.9, seed=1234, stream=True)
    assert got.token_ids == ref
    other = call(server, PROMPTS[0], max_tokens=16, temperature=0.9, top_k=30, top_p=0.9, seed=99)
    assert other.token_ids != ref


def test_sixteen_concurrent_streaming_clients(server, offline):
    jobs = [(PROMPTS[i % len(PROMPTS)], 8 + (i * 5) % 23) for i in range(16)]
    want = [offline.generate(p, max_new_tokens=n)[0] for p, n in jobs]
    results = [None] * len(jobs)

    def client(i):
        p, n = jobs[i]
        results[i] = call(server, p, max_tokens=n, stream=True)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for r, w in zip(results, want):
        assert r is not None and r.error is None
        assert r.token_ids == w.token_ids and r.text == w.text


def test_stop_strings_end_the_text_without_leaking(server, offline):
    ref = offline.generate(PROMPTS[1], max_new_tokens=24)[0]
    words = ref.text.split()
    stop = words[5] if words[5] not in words[:5] else words[6]
    cut = ref.text[:ref.text.index(stop)]
    for stream in (False, True):
        r = call(server, PROMPTS[1], max_tokens=24, stop=[stop, "w95 w94 w93"], stream=stream)
        assert r.error is None and r.text == cut and stop not in r.text
        assert r.stats["finish_reason"] == "stop"
    local = offline.generate(PROMPTS[1], max_new_tokens=24, stop=[stop])[0]
    assert local.text == cut and local.finish_reason == "stop"


@pytest.mark.parametrize("prompt,params,message", [
    (None, dict(max_tokens=4), "pass exactly one of text_input"),
    ([1, 2, 3], dict(max_tokens=(np.array([[4.0]], dtype=np.float32), "FP32")), "max_tokens"),
    ("w1 " * 120, dict(max_tokens=4), "max_seq_len"),
    ("w1 w2", dict(max_tokens=0), "max_tokens must be >= 1"),
    ("w1 w2", dict(max_tokens=4, temperature=-0.5), "temperature must be >= 0"),
    ("w1 w2", dict(max_tokens=4, top_p=0.0), "top_p must be in (0, 1]"),
    ("w1 w2", dict(max_tokens=4, top_p=1.5), "top_p must be in (0, 1]"),
    ([1, 2, 999], dict(max_tokens=4), "outside the vocabulary"),
])
def test_bad_requests_get_an_error_and_the_server_keeps_serving(server, offline, prompt, params, message):
    r = call(server, prompt, **params)
    assert r.error is not None and message in r.error, r.error
    ok = call(server, PROMPTS[0], max_tokens=10, stream=True)
    assert ok.error is None and ok.token_ids == offline.generate(PROMPTS[0], 10)[0].token_ids


def test_metrics_endpoint_answers(server):
    call(server, PROMPTS[0], max_tokens=4)
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as r:
        body = r.read().decode()
    assert r.status == 200 and 'nv_inference_request_success{model="specexport"' in body


def test_model_config_is_decoupled_python(server):
    with urllib.request.urlopen(f"http://{server.http_url}/v2/models/specexport/config", timeout=10) as r:
        cfg = json.loads(r.read())
    assert cfg["backend"] == "python" and cfg["model_transaction_policy"]["decoupled"] is True
    assert cfg["max_batch_size"] == 1  # tensors carry a batch dimension of 1, as TensorRT-LLM's clients send them
    assert {i["name"] for i in cfg["input"]} >= {"text_input", "input_ids", "max_tokens", "temperature", "top_k",
                                                  "top_p", "seed", "stop", "stream", "chat", "random_seed",
                                                  "stop_words", "end_id", "beam_width",
                                                  "exclude_input_in_output"}
    types = {i["name"]: (i["data_type"], i["dims"]) for i in cfg["input"]}
    assert types["random_seed"] == types["seed"] == ("TYPE_UINT64", [1])  # TensorRT-LLM's ensemble
    assert types["stop_words"] == ("TYPE_STRING", [-1]) and types["end_id"] == ("TYPE_INT32", [1])
    assert cfg["parameters"]["k"]["string_value"] == "3"
    with urllib.request.urlopen(f"http://{server.http_url}/v2/models/auto/config", timeout=10) as r:
        assert json.loads(r.read())["parameters"]["k"]["string_value"] == "auto"  # the default


def test_cli_writes_a_repository(texty_engine, tmp_path):
    from test_cli import run
    r = run("triton", texty_engine, "--repo", str(tmp_path), "--name", "m", "--instances", "2", "--max-batch", "2",
            "--standalone", "--python-path", "/a:/b", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["models"][0] == "m" and "m_target_verify_k3_greedy" in out["models"]
    cfg = (tmp_path / "m" / "config.pbtxt").read_text()
    assert "decoupled: true" in cfg and "count: 2" in cfg and '\\"/a\\", \\"/b\\"' in cfg
    assert 'key: "k" value: { string_value: "auto" }' in cfg and "max_batch_size: 1" in cfg  # the defaults
    assert (tmp_path / "m" / "1" / "engine" / "manifest.json").exists()
    standalone = (tmp_path / "m_target_verify_k3_greedy" / "config.pbtxt").read_text()
    assert 'backend: "onnxruntime"' in standalone and 'name: "key_out.0"' in standalone
    assert (tmp_path / "m_target_verify_k3_greedy" / "1" / "weights.safetensors").exists()
    bad = run("triton", texty_engine, "--repo", str(tmp_path), "--max-batch", "99")
    assert bad.returncode == 2 and "--max-batch 99 must be between 1 and the engine's max_batch 4" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_cancelled_streams_leave_the_server_serving(server, offline):
    import queue

    import tritonclient.grpc as g

    from specexport.triton.client import inputs
    clients = []
    for i in range(4):  # fill every row with long requests, then cancel them mid-stream
        c = g.InferenceServerClient(server.grpc_url)
        q = queue.Queue()
        c.start_stream(callback=lambda result, error, q=q: q.put((result, error)))
        c.async_stream_infer("specexport", inputs(PROMPTS[i % 2], max_tokens=60, stream=True))
        clients.append((c, q))
    for c, q in clients:
        result, error = q.get(timeout=60)  # at least one chunk arrived
        assert error is None
        c.stop_stream(cancel_requests=True)
        c.close()
    ok = call(server, PROMPTS[2], max_tokens=12, stream=True)
    assert ok.error is None and ok.token_ids == offline.generate(PROMPTS[2], 12)[0].token_ids
