"""Triton's HTTP generate extension (POST /v2/models/<name>/generate and /generate_stream, plain HTTP), and
TensorRT-LLM's input names and shapes, against the real tritonserver."""

import json
import urllib.error
import urllib.request

import numpy as np
import pytest

from specexport import SamplingParams, SpeculativeDecoder
from specexport.triton.client import generate

PROMPTS = ["w3 w4 w5 w3 w4", "w10 w11 w12 w13 w14 w15 w16 w10 w11 w12", "w7"]


@pytest.fixture(scope="module")
def offline(texty_engine):
    return SpeculativeDecoder.load(texty_engine, backend="onnxruntime", threads=1)


def post(server, body, stream=False, model="specexport"):
    """(HTTP status, JSON responses): one for /generate, one per server-sent event for /generate_stream."""
    url = f"http://{server.http_url}/v2/models/{model}/generate{'_stream' if stream else ''}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, raw = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read().decode()
    if not stream:
        return status, [json.loads(raw)]
    return status, [json.loads(line[len("data: "):]) for line in raw.splitlines() if line.startswith("data: ")]


def ids(v):
    return v if isinstance(v, list) else [v]  # Triton writes a one-element tensor as a bare number


def test_generate_equals_the_offline_runtime(server, offline):
    for p in PROMPTS:
        ref = offline.generate(p, max_new_tokens=20)[0]
        status, [r] = post(server, {"text_input": p, "max_tokens": 20})
        assert status == 200, r
        assert r["text_output"] == ref.text and ids(r["output_ids"]) == ref.token_ids
        assert r["finish_reason"] == "length" and r["completion_tokens"] == 20
        assert r["drafted"] == ref.stats.drafted and r["accepted"] == ref.stats.accepted
    status, [r] = post(server, {"input_ids": offline.encode(PROMPTS[0]), "max_tokens": 12})
    assert status == 200 and ids(r["output_ids"]) == offline.generate(PROMPTS[0], max_new_tokens=12)[0].token_ids


def test_generate_stream_concatenates_to_the_same_text(server, offline):
    for p in PROMPTS:
        ref = offline.generate(p, max_new_tokens=24)[0]
        status, events = post(server, {"text_input": p, "max_tokens": 24, "stream": True}, stream=True)
        assert status == 200 and len(events) > 1
        assert "".join(e["text_output"] for e in events) == ref.text
        assert sum((ids(e["output_ids"]) for e in events), []) == ref.token_ids
        assert [("finish_reason" in e) for e in events] == [False] * (len(events) - 1) + [True]
        assert events[-1]["drafted"] == ref.stats.drafted
    # generate_stream without stream=true: the whole text in one event
    status, events = post(server, {"text_input": PROMPTS[0], "max_tokens": 24}, stream=True)
    assert status == 200 and len(events) == 1
    assert events[0]["text_output"] == offline.generate(PROMPTS[0], max_new_tokens=24)[0].text


def test_generate_stop_and_sampling_parameters(server, offline):
    ref = offline.generate(PROMPTS[1], max_new_tokens=24)[0]
    words = ref.text.split()
    stop = words[5] if words[5] not in words[:5] else words[6]
    status, [r] = post(server, {"text_input": PROMPTS[1], "max_tokens": 24, "stop": [stop]})
    assert status == 200 and r["text_output"] == ref.text[:ref.text.index(stop)] and r["finish_reason"] == "stop"
    sp = SamplingParams(0.9, top_k=30, top_p=0.9, seed=1234)
    want = offline.generate(PROMPTS[0], max_new_tokens=16, sampling=sp)[0].token_ids
    body = {"text_input": PROMPTS[0], "max_tokens": 16, "temperature": 0.9, "top_k": 30, "top_p": 0.9}
    for seed in ({"seed": 1234}, {"random_seed": 1234}, {"seed": 1234, "random_seed": 1234}):
        status, [r] = post(server, {**body, **seed})
        assert status == 200 and ids(r["output_ids"]) == want, seed


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("body,message", [
    ({"max_tokens": 4}, "pass exactly one of text_input"),
    ({"text_input": "w1 w2", "max_tokens": 0}, "max_tokens must be >= 1, got 0"),
    ({"text_input": "w1 " * 120, "max_tokens": 4}, "max_seq_len"),
    ({"text_input": "w1 w2", "top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"text_input": "w1 w2", "seed": 1, "random_seed": 2}, "seed and random_seed (its TensorRT-LLM name) differ"),
    ({"text_input": "w1 w2", "stop": ["w3"], "stop_words": ["w4"]}, "stop and stop_words"),
    ({"text_input": "w1 w2", "end_id": 999}, "end_id 999 is outside the vocabulary [0, 96)"),
    ({"input_ids": [1, 2, 999], "max_tokens": 4}, "outside the vocabulary"),
])
def test_generate_errors_are_http_errors_and_the_server_keeps_serving(server, offline, body, message, stream):
    status, responses = post(server, {**body, "stream": stream}, stream=stream)
    assert status == 400 and len(responses) == 1 and message in responses[0]["error"], responses
    status, [r] = post(server, {"text_input": PROMPTS[2], "max_tokens": 6})
    assert status == 200 and r["text_output"] == offline.generate(PROMPTS[2], max_new_tokens=6)[0].text


def test_streaming_on_the_non_streaming_endpoint_is_an_error(server, offline):
    """Triton's /generate takes exactly one response; stream=true sends one per step. Triton has already sent
    status 200 when the second response comes, so the error is in the body (a Triton limitation)."""
    _, [r] = post(server, {"text_input": PROMPTS[0], "max_tokens": 12, "stream": True})
    assert "exactly 1 response" in r["error"]
    status, [r] = post(server, {"text_input": PROMPTS[0], "max_tokens": 12})
    assert status == 200 and r["text_output"] == offline.generate(PROMPTS[0], max_new_tokens=12)[0].text


def test_tensorrt_llm_curl_example(server, offline):
    """The body TensorRT-LLM's docs send to their ensemble (empty bad_words / stop_words mean none)."""
    ref = offline.generate(PROMPTS[1], max_new_tokens=20)[0]
    body = {"text_input": PROMPTS[1], "max_tokens": 20, "bad_words": "", "stop_words": ""}
    status, [r] = post(server, body)
    assert status == 200 and r["text_output"] == ref.text
    status, events = post(server, {**body, "stream": True}, stream=True)
    assert status == 200 and "".join(e["text_output"] for e in events) == ref.text


def test_tensorrt_llm_shaped_grpc_requests(server, offline):
    """Tensors shaped and typed as TensorRT-LLM's end_to_end_grpc_client sends them to the ensemble: [1, 1] with the
    batch dimension, text_input BYTES, max_tokens INT32, stream BOOL, temperature FP32, random_seed UINT64,
    stop_words BYTES [1, n], end_id INT32, beam_width INT32, exclude_input_in_output BOOL."""
    def trt(prompt, max_tokens, **extra):
        t = {"text_input": (np.array([[prompt]]).astype(object), "BYTES"),
             "max_tokens": (np.ones((1, 1), dtype=np.int32) * max_tokens, "INT32"),
             "stream": (np.array([[True]], dtype=bool), "BOOL"),
             "temperature": (np.array([[extra.pop("temperature", 0.0)]], dtype=np.float32), "FP32")}
        for name, value in extra.items():
            if name == "stop_words":
                t[name] = (np.array([value], dtype=object), "BYTES")
            else:
                dtype = {"random_seed": (np.uint64, "UINT64"), "seed": (np.uint64, "UINT64"),
                         "end_id": (np.int32, "INT32"), "top_k": (np.int32, "INT32"), "top_p": (np.float32, "FP32"),
                         "beam_width": (np.int32, "INT32"), "exclude_input_in_output": (bool, "BOOL")}
                t[name] = (np.array([[value]], dtype=dtype[name][0]), dtype[name][1])
        return generate(server.grpc_url, "specexport", timeout=120, **t)

    ref = offline.generate(PROMPTS[1], max_new_tokens=20)[0]
    r = trt(PROMPTS[1], 20)
    assert r.error is None and r.chunks > 1 and r.token_ids == ref.token_ids and r.text == ref.text

    sp = SamplingParams(0.9, top_k=30, top_p=0.9, seed=1234)
    want = offline.generate(PROMPTS[0], max_new_tokens=16, sampling=sp)[0].token_ids
    r = trt(PROMPTS[0], 16, temperature=0.9, top_k=30, top_p=0.9, random_seed=1234)
    assert r.error is None and r.token_ids == want

    words = ref.text.split()
    stop = words[5] if words[5] not in words[:5] else words[6]
    r = trt(PROMPTS[1], 20, stop_words=[stop, ""])
    assert r.error is None and r.text == ref.text[:ref.text.index(stop)] and r.stats["finish_reason"] == "stop"

    end_id = ref.token_ids[4]
    local = offline.generate(PROMPTS[1], max_new_tokens=20, stop_token_ids=[end_id])[0]
    assert local.finish_reason == "stop" and len(local.token_ids) < 20
    r = trt(PROMPTS[1], 20, end_id=end_id)
    assert r.error is None and r.token_ids == local.token_ids and r.stats["finish_reason"] == "stop"
    r = trt(PROMPTS[1], 20, end_id=-1)  # TensorRT-LLM's "no end id"
    assert r.error is None and r.token_ids == ref.token_ids

    r = trt(PROMPTS[1], 20, beam_width=1, exclude_input_in_output=True)  # what their client adds: what we do
    assert r.error is None and r.token_ids == ref.token_ids
    assert "beam_width must be 1" in trt(PROMPTS[1], 20, beam_width=2).error
    assert "exclude_input_in_output=false is not supported" in trt(PROMPTS[1], 20, exclude_input_in_output=False).error


def test_one_prompt_per_request(server, offline):
    """max_batch_size 1: a request with two rows is refused by Triton itself; the server keeps serving."""
    r = generate(server.grpc_url, "specexport", timeout=120,
                 text_input=(np.array([[b"w1"], [b"w2"]], dtype=object), "BYTES"),
                 max_tokens=(np.array([[4], [4]], dtype=np.int32), "INT32"))
    assert r.error is not None and "batch" in r.error, r.error
    ok = generate(server.grpc_url, "specexport", PROMPTS[2], timeout=120, max_tokens=6)
    assert ok.error is None and ok.token_ids == offline.generate(PROMPTS[2], max_new_tokens=6)[0].token_ids
