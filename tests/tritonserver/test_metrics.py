"""The batcher's SpecMetrics on Triton's metrics endpoint (the python backend's metrics API), counted against the
per-request stats the model returns. Only these tests use the `metered` model (k=3, one cache row)."""

import json
import queue
import re
import socket
import time
import urllib.request

import pytest

from specexport.serve.metrics import COUNTERS, GAUGES, PREFIX
from specexport.triton.client import generate, inputs

MODEL = "metered"
LINE = re.compile(r'^(\w+)(?:\{(.*)\})? (\S+)$')


def scrape(server) -> dict:
    """{(name, frozenset(labels)): value} for the metered model's series."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as r:
        body = r.read().decode()
    out = {}
    for line in body.splitlines():
        m = LINE.match(line)
        if not m or line.startswith("#"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if labels.pop("model", None) == MODEL:
            out[(m.group(1), frozenset(labels.items()))] = float(m.group(3))
    return out


def value(metrics, name, **labels):
    return metrics.get((PREFIX + name, frozenset({"version": "1", **labels}.items())), 0.0)


def total(metrics, name):
    return sum(v for (n, _), v in metrics.items() if n == PREFIX + name)


def post(server, body):
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/{MODEL}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_metrics_count_what_the_requests_returned(server):
    before = scrape(server)
    prompts = ["w3 w4 w5 w3 w4", "w10 w11 w12 w13 w14 w15 w16 w10 w11 w12", "w7", "w20 w21 w20 w21 w20"]
    stats = []
    for i, p in enumerate(prompts):  # over gRPC (streamed and not) and the HTTP generate endpoint
        if i % 2:
            stats.append(post(server, {"text_input": p, "max_tokens": 16 + i}))
        else:
            r = generate(server.grpc_url, MODEL, p, timeout=120, max_tokens=16 + i, stream=i == 2)
            assert r.error is None, r.error
            stats.append(r.stats)
    after = scrape(server)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    n = len(prompts)
    assert delta("requests_total", finish_reason="length") == n
    assert delta("generation_tokens_total") == sum(s["completion_tokens"] for s in stats) == sum(range(16, 16 + n))
    assert delta("prompt_tokens_total") == sum(s["prompt_tokens"] for s in stats)
    drafted, accepted = sum(s["drafted"] for s in stats), sum(s["accepted"] for s in stats)
    assert drafted > 0 and accepted > 0
    assert delta("spec_decode_num_draft_tokens_total") == drafted
    assert delta("spec_decode_num_accepted_tokens_total") == accepted
    assert total(after, "spec_decode_num_accepted_tokens_per_pos_total") - \
        total(before, "spec_decode_num_accepted_tokens_per_pos_total") == accepted
    assert total(after, "steps_total") > total(before, "steps_total")
    # every SpecMetrics name shows, counters with Prometheus' _total (Triton adds no suffix of its own)
    names = {name for name, _ in after}
    assert {PREFIX + c + "_total" for c in COUNTERS} <= names and {PREFIX + g for g in GAUGES} <= names
    assert value(after, "num_requests_running") == 0 and value(after, "num_requests_waiting") == 0


def grpc_victim(server):
    """A streaming gRPC request; cancel() cancels it (tritonclient's stop_stream with cancel_requests)."""
    import tritonclient.grpc as g
    c = g.InferenceServerClient(server.grpc_url)
    c.start_stream(callback=lambda result, error: None)
    c.async_stream_infer(MODEL, inputs("w7", max_tokens=90), request_id="victim")

    def cancel():
        c.stop_stream(cancel_requests=True)
        c.close()
    return cancel


def http_victim(server):
    """A generate_stream request over a raw socket; cancel() closes the connection without reading."""
    body = json.dumps({"text_input": "w7", "max_tokens": 90, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", server.http_port), timeout=30)
    s.sendall(f"POST /v2/models/{MODEL}/generate_stream HTTP/1.1\r\nHost: 127.0.0.1\r\n"
              f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    return s.close


@pytest.mark.parametrize("victim", [grpc_victim, http_victim], ids=["grpc-cancel", "http-disconnect"])
def test_a_cancelled_request_counts_as_cancelled(server, victim):
    """One cache row: a queue of long requests, then one more that is cancelled once the model holds it (Triton has
    executed every request); it leaves the queue as cancelled, the others finish by length. Over gRPC the client
    cancels; over HTTP (generate_stream) it hangs up, which Triton passes on as a cancellation."""
    import tritonclient.grpc as g
    before = scrape(server)
    queued = 32  # each 90 tokens: the victim waits a while behind them
    c = g.InferenceServerClient(server.grpc_url)
    done: queue.Queue = queue.Queue()
    c.start_stream(callback=lambda result, error: done.put((result, error)))
    for i in range(queued):
        c.async_stream_infer(MODEL, inputs("w7", max_tokens=90), request_id=str(i))
    cancel = victim(server)
    executed = lambda m: m.get(("nv_inference_exec_count", frozenset({("version", "1")})), 0.0)  # noqa: E731
    deadline = time.time() + 60
    while time.time() < deadline:  # until the model holds the victim (its execute has returned)
        now = scrape(server)
        if executed(now) - executed(before) >= queued + 1:
            break
    assert value(now, "num_requests_waiting") >= 1  # the victim at least
    cancel()
    for _ in range(queued):
        result, error = done.get(timeout=120)
        assert error is None
    c.stop_stream()
    c.close()

    def delta(m, reason):
        return value(m, "requests_total", finish_reason=reason) - value(before, "requests_total", finish_reason=reason)

    deadline = time.time() + 30
    while time.time() < deadline:
        after = scrape(server)
        if delta(after, "cancelled") + delta(after, "length") == queued + 1:
            break
        time.sleep(0.1)
    assert delta(after, "cancelled") == 1 and delta(after, "length") == queued
    assert value(after, "num_requests_running") == 0 and value(after, "num_requests_waiting") == 0
