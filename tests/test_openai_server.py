"""The OpenAI-compatible server on 127.0.0.1 (uvicorn, in this process) over the tiny ONNX engine, driven by the
real `openai` client and raw HTTP: greedy text equals the offline runtime's, streamed and not; 64 concurrent
streams with a quarter disconnecting; hostile and malformed requests each get the right 4xx and the server
keeps answering; auth; 429 when the queue is full; metrics."""

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from specexport import SamplingParams, SpeculativeDecoder

openai = pytest.importorskip("openai", reason="the OpenAI server tests need the openai client ([dev] extra)")
pytest.importorskip("uvicorn", reason="the OpenAI server needs the [serve] extra")

PROMPTS = ["w3 w4 w5 w3 w4", "w10 w11 w12 w13 w14 w15 w16 w10 w11 w12", "w7", " ".join(f"w{i % 40}" for i in range(50))]
KEY = "sk-test-key"


class Running:
    """An OpenAIServer on a free port, uvicorn in a thread."""

    def __init__(self, dec, **options):
        import uvicorn
        from specexport.serve.openai_server import OpenAIServer
        self.srv = OpenAIServer(dec, "tiny", **options)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.srv.app, log_level="warning", timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started and time.time() < deadline:
            time.sleep(0.02)
        assert self.server.started

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.srv.close()


@pytest.fixture(scope="module")
def offline(texty_engine):
    return SpeculativeDecoder.load(texty_engine, backend="onnxruntime", threads=1)


@pytest.fixture(scope="module")
def server(texty_engine):
    dec = SpeculativeDecoder.load(texty_engine, backend="onnxruntime", threads=1)
    r = Running(dec, k="auto", api_key=KEY, max_waiting=64, max_body_bytes=64 * 1024)
    yield r
    r.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def http(server, method, path, body=None, headers=None, raw: bytes | None = None):
    """-> (status, parsed JSON or text, headers)."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **(headers or {})}
    h = {k: v for k, v in h.items() if v is not None}
    req = urllib.request.Request(server.url + path, data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status, text, hdrs = resp.status, resp.read().decode(), dict(resp.headers)
    except urllib.error.HTTPError as e:
        status, text, hdrs = e.code, e.read().decode(), dict(e.headers)
    try:
        return status, json.loads(text), hdrs
    except ValueError:
        return status, text, hdrs


def chat_ref(offline, content, n):
    return offline.generate(content, max_new_tokens=n, chat=True)[0]


# ---- the openai client ------------------------------------------------------------------------------------

def test_completions_equal_the_offline_runtime(client, offline):
    for p in PROMPTS:
        ref = offline.generate(p, max_new_tokens=12)[0]
        r = client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0)
        assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
        assert r.usage.completion_tokens == len(ref.token_ids) and r.usage.prompt_tokens == len(offline.encode(p))
        ext = r.model_extra["specexport"]
        assert ext["new_tokens"] == len(ref.token_ids) and ext["k"] == "auto"
        assert sum(ext["accepted_per_pos"][:1]) <= ext["accepted"] <= ext["drafted"]
        streamed = client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == ref.text
    ids = offline.encode(PROMPTS[1])  # a token-id prompt
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0)
    assert r.choices[0].text == offline.generate(ids, max_new_tokens=12)[0].text


def test_chat_equals_the_offline_runtime_streamed_and_not(client, offline):
    for p in PROMPTS[:3]:
        ref = chat_ref(offline, p, 10)
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": p}],
                                           max_completion_tokens=10, temperature=0)
        assert r.choices[0].message.content == ref.text and r.choices[0].message.role == "assistant"
        assert r.usage.total_tokens == r.usage.prompt_tokens + len(ref.token_ids)
        chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": p}],
                                                     max_tokens=10, temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
        assert chunks[0].choices[0].delta.role == "assistant"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    # a conversation goes through the template whole, and text parts join
    msgs = [{"role": "system", "content": "w5"}, {"role": "user", "content": [{"type": "text", "text": "w6 w7"}]}]
    ids = offline.encode_chat([{"role": "system", "content": "w5"}, {"role": "user", "content": "w6 w7"}])
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == offline.generate(ids, max_new_tokens=8)[0].text


def test_stop_sequences_and_sampling_with_a_seed(client, offline):
    ref = offline.generate(PROMPTS[1], max_new_tokens=12)[0]
    words = ref.text.split()
    stop = f"{words[3]} {words[4]}"
    r = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].text == ref.text[:ref.text.index(stop)] and r.choices[0].finish_reason == "stop"


def test_a_seed_reproduces_the_offline_sample_at_a_fixed_k(texty_engine, offline):
    # (at k="auto" the k of each step depends on measured times: the distribution is exact, the draw is not fixed)
    r = Running(SpeculativeDecoder.load(texty_engine, backend="onnxruntime", threads=1), k=3)
    try:
        c = openai.OpenAI(base_url=r.url + "/v1", api_key="none", max_retries=0, timeout=60)
        sp = SamplingParams(0.9, top_k=20, top_p=0.9, seed=7)
        want = offline.generate(PROMPTS[0], max_new_tokens=10, sampling=sp, k=3)[0].text
        got = [c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=10, temperature=0.9, top_p=0.9,
                                    seed=7, extra_body={"top_k": 20}).choices[0].text for _ in range(2)]
        assert got == [want, want]
    finally:
        r.stop()


def test_ignore_eos_runs_past_the_end_of_sequence(client, offline):
    eos = sorted(offline.eos_token_ids)
    ref = offline.generate(PROMPTS[2], max_new_tokens=30)[0]
    r = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=30, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 30 and r.choices[0].finish_reason == "length"
    if ref.finish_reason == "stop":  # (the tiny model may never emit EOS in 30 tokens)
        assert len(ref.token_ids) < 30 and eos


def test_models_health_and_auth(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert http(server, "GET", "/health", headers={"Authorization": None})[0] == 200
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="w1", max_tokens=2)
    status, body, _ = http(server, "POST", "/v1/completions", {"model": "tiny", "prompt": "w1"},
                           headers={"Authorization": None})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


# ---- hostile and malformed requests -------------------------------------------------------------------------

C, CH = "/v1/completions", "/v1/chat/completions"
OK = {"model": "tiny", "prompt": "w1 w2", "max_tokens": 3, "temperature": 0}
OKC = {"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "max_tokens": 3, "temperature": 0}
BAD = [  # (path, body or raw bytes, extra headers, status, a fragment of the message)
    (C, b"{not json", None, 400, "not valid JSON"),
    (C, b"[1, 2]", None, 400, "JSON object"),
    (C, b"\xff\xfe", None, 400, "not valid JSON"),
    (C, b"", None, 400, "not valid JSON"),
    (C, {"prompt": "w1"}, None, 400, "'model' is required"),
    (C, {**OK, "model": "gpt-4"}, None, 404, "does not exist"),
    (C, {"model": "tiny"}, None, 400, "'prompt' is required"),
    (C, {**OK, "prompt": 5}, None, 400, "'prompt' is required"),
    (C, {**OK, "prompt": ["w1", "w2"]}, None, 400, "batched prompts"),
    (C, {**OK, "prompt": [[1, 2], [3]]}, None, 400, "batched prompts"),
    (C, {**OK, "prompt": [1, "a"]}, None, 400, "token ids"),
    (C, {**OK, "prompt": [1, 2, 100000]}, None, 400, "outside the vocabulary"),
    (C, {**OK, "max_tokens": "ten"}, None, 400, "'max_tokens' must be an integer"),
    (C, {**OK, "max_tokens": 0}, None, 400, "'max_tokens' must be >= 1"),
    (C, {**OK, "max_tokens": 10**6}, None, 400, "max_seq_len"),
    (C, {**OK, "max_tokens": True}, None, 400, "must be an integer"),
    (C, {**OK, "temperature": -1}, None, 400, "'temperature' must be in"),
    (C, {**OK, "temperature": "hot"}, None, 400, "'temperature' must be a number"),
    (C, {**OK, "top_p": 0}, None, 400, "'top_p' must be in"),
    (C, {**OK, "top_p": 1.5}, None, 400, "'top_p' must be in"),
    (C, {**OK, "top_k": -5}, None, 400, "'top_k' must be >= -1"),
    (C, {**OK, "seed": 1.5}, None, 400, "'seed' must be an integer"),
    (C, {**OK, "stop": ""}, None, 400, "'stop' must be"),
    (C, {**OK, "stop": ["a", "b", "c", "d", "e"]}, None, 400, "at most 4"),
    (C, {**OK, "stop": [1]}, None, 400, "'stop' must be"),
    (C, {**OK, "n": 2}, None, 400, "n > 1 is not supported"),
    (C, {**OK, "logprobs": 2}, None, 400, "logprobs are not supported"),
    (C, {**OK, "echo": True}, None, 400, "echo is not supported"),
    (C, {**OK, "best_of": 3}, None, 400, "best_of"),
    (C, {**OK, "presence_penalty": 0.5}, None, 400, "presence_penalty"),
    (C, {**OK, "logit_bias": {"5": 10}}, None, 400, "logit_bias"),
    (C, {**OK, "stream": "yes"}, None, 400, "'stream' must be true or false"),
    (C, {**OK, "stream_options": {"include_usage": True}}, None, 400, "only allowed when 'stream' is true"),
    (C, {**OK, "max_tokens": 3, "max_completion_tokens": 4}, None, 400, "disagree"),
    (C, {**OK, "min_tokens": 5}, None, 400, "min_tokens is not supported"),
    (C, {**OK, "ignore_eos": "yes"}, None, 400, "'ignore_eos' must be true or false"),
    (C, {**OK, "prompt": "w1 " * 40000}, None, 413, "exceeds"),
    (C, OK, {"Content-Length": "99999999999"}, 413, "exceeds"),
    (C, OK, {"Authorization": "Bearer nope"}, 401, "API key"),
    (C, OK, {"Authorization": "Basic " + KEY}, 401, "API key"),
    (CH, {**OKC, "messages": []}, None, 400, "'messages' is required"),
    (CH, {**OKC, "messages": "hi"}, None, 400, "'messages' is required"),
    (CH, {**OKC, "messages": [{"role": "wizard", "content": "w1"}]}, None, 400, "role must be one of"),
    (CH, {**OKC, "messages": [{"role": "user", "content": 7}]}, None, 400, "content must be"),
    (CH, {**OKC, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     None, 400, "images"),
    (CH, {**OKC, "messages": ["w1"]}, None, 400, "must be an object"),
    (CH, {**OKC, "tools": [{"type": "function", "function": {"name": "f"}}]}, None, 400, "tools are not supported"),
    (CH, {**OKC, "logprobs": True}, None, 400, "logprobs"),
    (CH, {**OKC, "response_format": {"type": "json_object"}}, None, 400, "response_format"),
    ("/v1/embeddings", OK, None, 404, "Not Found"),
    ("/v1/models", OK, None, 405, "Method Not Allowed"),
]


@pytest.mark.parametrize("path,body,headers,status,message", BAD,
                         ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_requests_get_the_right_4xx_and_the_server_keeps_serving(server, offline, path, body, headers, status,
                                                                     message):
    raw = body if isinstance(body, bytes) else None
    got, answer, _ = http(server, "POST", path, None if raw is not None else body, headers, raw=raw)
    assert got == status, answer
    assert message in answer["error"]["message"] and answer["error"]["type"]
    got, answer, _ = http(server, "POST", C, OK)  # still serving, correctly
    assert got == 200 and answer["choices"][0]["text"] == offline.generate("w1 w2", max_new_tokens=3)[0].text


# ---- load: 64 streams, a quarter of them walk away ----------------------------------------------------------

def test_64_concurrent_streams_with_disconnects(server, offline):
    refs = {p: offline.generate(p, max_new_tokens=40, chat=False)[0].text for p in PROMPTS}
    m = server.srv.metrics
    cancelled_before = m.value("requests", finish_reason="cancelled")
    errors_before = m.value("requests", finish_reason="error")
    finished_before = sum(m.value("requests", finish_reason=r) for r in ("stop", "length", "cancelled", "error"))
    results, statuses = [None] * 64, []

    def client(i):
        p = PROMPTS[i % len(PROMPTS)]
        c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        try:
            stream = c.completions.create(model="tiny", prompt=p, max_tokens=40, temperature=0, stream=True)
        except openai.APIStatusError as e:
            statuses.append(e.status_code)
            return
        statuses.append(200)
        text = []
        for events, chunk in enumerate(stream, 1):
            text.append(chunk.choices[0].text)
            if i % 4 == 3 and events == 2:  # walk away midway: the connection closes
                stream.close()
                results[i] = "left"
                return
        results[i] = ("".join(text), p)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert all(s == 200 for s in statuses) and len(statuses) == 64
    done = [r for r in results if r != "left"]
    assert len(done) == 48 and all(text == refs[p] for text, p in done)
    b = server.srv.batcher
    deadline = time.time() + 30
    while (b.batch.rows() or b.waiting.qsize()) and time.time() < deadline:
        time.sleep(0.05)
    assert not b.batch.rows() and b.waiting.qsize() == 0  # every row is free again
    m = server.srv.metrics
    finished = sum(m.value("requests", finish_reason=r) for r in ("stop", "length", "cancelled", "error"))
    assert finished - finished_before == 64 and m.value("requests", finish_reason="error") == errors_before
    # (a stream that walked away is cancelled unless it finished before its disconnect was seen: the tiny model
    # is fast; test_a_client_that_leaves_frees_its_row shows the cancellation itself)
    assert m.value("requests", finish_reason="cancelled") - cancelled_before <= 16
    status, body, _ = http(server, "POST", C, OK)
    assert status == 200


def test_metrics_endpoint(server):
    status, text, hdrs = http(server, "GET", "/metrics", headers={"Authorization": None})
    assert status == 200 and "text/plain" in hdrs["content-type"]
    lines = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}
    m = server.srv.metrics
    assert lines["specexport_spec_decode_num_draft_tokens_total"] == m.value("spec_decode_num_draft_tokens") > 0
    assert lines["specexport_spec_decode_num_accepted_tokens_total"] == m.value("spec_decode_num_accepted_tokens")
    assert lines['specexport_spec_decode_num_accepted_tokens_per_pos_total{position="1"}'] > 0
    assert lines['specexport_requests_total{finish_reason="length"}'] > 0
    assert "specexport_num_requests_waiting" in lines and "specexport_num_requests_running" in lines
    assert any(name.startswith('specexport_steps_total{k=') for name in lines)


# ---- queue limit and disconnects of non-streaming requests ----------------------------------------------------

@pytest.fixture(scope="module")
def slow_model(tmp_path_factory):
    """A tiny llama with a word tokenizer, decoded eagerly with one row: 1500 tokens take seconds, so a long
    request is still running while a test acts."""
    from helpers import WORDS, make_tiny, word_tokenizer
    path = tmp_path_factory.mktemp("slow") / "m"
    make_tiny(path, "llama", seed=5, tokenizer=word_tokenizer(WORDS), logit_scale=4.0, tie_word_embeddings=False)
    return str(path)


def slow_server(path, **options):
    dec = SpeculativeDecoder.from_pretrained(path, k=3, max_seq_len=2048, max_batch=1)
    return Running(dec, k=3, **options)


def test_full_queue_gets_429_with_retry_after(slow_model):
    r = slow_server(slow_model, max_waiting=1)
    try:
        b = r.srv.batcher
        long = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 1500, "temperature": 0}
        started = [threading.Thread(target=http, args=(r, "POST", C, long)) for _ in range(2)]
        for th in started:
            th.start()
            deadline = time.time() + 10  # one running, then one waiting
            while len(b.batch.rows()) + b.waiting.qsize() < started.index(th) + 1 and time.time() < deadline:
                time.sleep(0.002)
        status, body, hdrs = http(r, "POST", C, long)
        assert status == 429 and hdrs["retry-after"] == "1" and body["error"]["type"] == "rate_limit_error"
        for th in started:
            th.join(60)
        assert http(r, "POST", C, {**long, "max_tokens": 4})[0] == 200
    finally:
        r.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_frees_its_row(slow_model, stream):
    r = slow_server(slow_model)
    try:
        req = urllib.request.Request(r.url + C, method="POST", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 1500,
                                                      "temperature": 0, "stream": stream}).encode())
        if stream:
            with urllib.request.urlopen(req, timeout=30) as resp:
                assert resp.readline().startswith(b"data: ")  # streaming has begun; then the client leaves
        else:
            with pytest.raises(TimeoutError):  # the client gives up and closes the connection
                urllib.request.urlopen(req, timeout=0.3)
        deadline = time.time() + 10
        while r.srv.metrics.value("requests", finish_reason="cancelled") < 1 and time.time() < deadline:
            time.sleep(0.05)
        assert r.srv.metrics.value("requests", finish_reason="cancelled") == 1
        assert r.srv.metrics.value("requests", finish_reason="length") == 0
        assert not r.srv.batcher.batch.rows()
    finally:
        r.stop()


def test_cli_serves_an_engine_folder_and_refuses_bad_input(texty_engine, tmp_path):
    import os
    import subprocess
    import sys
    cli = [sys.executable, "-m", "specexport.cli", "openai"]
    bad = subprocess.run(cli + [str(tmp_path / "missing")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and bad.stderr.startswith("specexport: error:")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    env = {**os.environ, "SPECEXPORT_API_KEY": "from-env"}
    proc = subprocess.Popen(cli + [texty_engine, "--port", str(port), "--threads", "1"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline, up = time.time() + 120, False
        while not up and time.time() < deadline and proc.poll() is None:
            try:
                up = urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200
            except OSError:
                time.sleep(0.2)
        assert up, proc.stderr.read() if proc.poll() is not None else "no answer"
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="from-env", max_retries=0, timeout=60)
        assert [m.id for m in c.models.list().data] == ["engine"]  # the folder's name
        r = c.chat.completions.create(model="engine", messages=[{"role": "user", "content": "w3 w4"}], max_tokens=4,
                                      temperature=0)
        assert r.usage.completion_tokens == 4 and r.model_extra["specexport"]["k"] == "auto"
    finally:
        proc.terminate()
        proc.wait(30)


def test_server_process_hands_the_gil_over_quickly(monkeypatch):
    import sys
    from specexport.serve.openai_server import SWITCH_INTERVAL, set_switch_interval
    before = sys.getswitchinterval()
    try:
        assert set_switch_interval() == SWITCH_INTERVAL and abs(sys.getswitchinterval() - SWITCH_INTERVAL) < 1e-9
        monkeypatch.setenv("SPECEXPORT_SWITCH_INTERVAL", "0.001")
        assert set_switch_interval() == 0.001
    finally:
        sys.setswitchinterval(before)
