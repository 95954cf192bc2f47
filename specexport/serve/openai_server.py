"""`specexport openai`: an OpenAI-compatible HTTP server (Starlette on uvicorn) over the continuous batcher.

  GET  /v1/models                 the one served model
  POST /v1/completions            text or token-id prompt; stream by server-sent events or one JSON answer
  POST /v1/chat/completions       messages through the model's chat template; the same two ways
  GET  /health                    200 while the batcher runs (503 once it has stopped)
  GET  /metrics                   Prometheus text: serve/metrics.py's counters and gauges

Every answer carries `usage` and a `specexport` object with the request's speculation stats. One request is
one row of the batcher: a client that disconnects (stream or not) is cancelled and its row is free at the next
step. Limits: request bodies over `max_body_bytes` get 413; when `max_waiting` requests already wait for a
row, a new one gets 429 with Retry-After. With an API key, /v1/* needs `Authorization: Bearer <key>` (401).
The engine runs on the batcher's thread; the event loop only parses, queues and writes.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import sys
import threading
import time
from pathlib import Path

from ..errors import SpecExportError
from ..runtime import SpeculativeDecoder
from .batcher import Chunk, ContinuousBatcher, QueueFull
from .metrics import SpecMetrics
from .openai_protocol import (ApiError, GenRequest, chunk_body, completion_body, new_id, parse_chat,
                              parse_completion, usage_chunk)

API_KEY_ENV = "SPECEXPORT_API_KEY"
MAX_BODY_BYTES = 1 << 20  # 1 MiB: far more than max_seq_len tokens of text


class OpenAIServer:
    """The app's state: one decoder, one batcher, the served model's name, the limits."""

    def __init__(self, dec: SpeculativeDecoder, model: str, k: int | str | None = "auto", speculative: bool = True,
                 max_waiting: int = 64, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES):
        if dec.tokenizer is None:
            raise SpecExportError("the OpenAI server answers with text, and this model has no tokenizer: build the "
                                  "engine from a checkpoint that has one")
        self.dec, self.model = dec, model
        self.batcher = ContinuousBatcher(dec, speculative=speculative, k=k, max_waiting=max_waiting)
        self.metrics: SpecMetrics = self.batcher.metrics
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.default_temperature = 1.0 if dec.can_sample else 0.0  # OpenAI's default, where the engine samples
        self.created = int(time.time())
        self.app = _make_app(self)

    def close(self) -> None:
        self.batcher.close()

    # ---- one generation -------------------------------------------------------------------------------

    def _ids(self, g: GenRequest) -> list[int]:
        if g.messages is not None:
            return self.dec.encode_chat(g.messages)
        return self.dec.encode(g.prompt)

    async def start(self, g: GenRequest) -> tuple[asyncio.Queue, threading.Event]:
        """Queue the request on the batcher -> (its chunks, as they come; the flag that cancels it)."""
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()
        try:
            ids = await asyncio.to_thread(self._ids, g)
            max_tokens = g.max_tokens
            if max_tokens is None:  # chat without a limit: up to the context length
                max_tokens = max(self.dec.config.max_seq_len - len(ids), 1)
            self.batcher.submit(ids, lambda c: loop.call_soon_threadsafe(chunks.put_nowait, c),
                                max_new_tokens=max_tokens, sampling=g.sampling, stop=g.stop,
                                is_cancelled=cancelled.is_set, block=False, ignore_eos=g.ignore_eos)
        except QueueFull as e:
            raise ApiError(429, str(e), code="rate_limit_exceeded", kind="rate_limit_error",
                           headers={"Retry-After": "1"}) from None
        except SpecExportError as e:
            if not self.batcher.alive:
                raise ApiError(503, str(e), kind="server_error") from None
            param = "messages" if g.messages is not None else "prompt"
            if "max_new_tokens" in str(e) or "max_seq_len" in str(e):
                param = "max_tokens"
            raise ApiError(400, str(e).replace("max_new_tokens", "max_tokens"), param) from None
        return chunks, cancelled


async def _disconnected(request) -> None:
    """Returns when the client disconnects: reading past the body resumes the socket, so the disconnect is seen
    while the answer is being generated (as vLLM does)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _next(chunks: asyncio.Queue, watcher: asyncio.Future) -> Chunk | None:
    """The request's next chunk, or None once the client has gone."""
    get = asyncio.ensure_future(chunks.get())
    await asyncio.wait({get, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if get.done():
        return get.result()
    get.cancel()
    return None


def _error(e: ApiError):
    from starlette.responses import JSONResponse
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _make_app(srv: OpenAIServer):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    class Collector:  # SpecMetrics -> Prometheus families, read at each scrape
        def collect(self):
            families: dict[str, object] = {}
            for s in srv.metrics.samples():
                fam = families.get(s.name)
                if fam is None:
                    cls = CounterMetricFamily if s.kind == "counter" else GaugeMetricFamily
                    fam = families[s.name] = cls(s.name, s.help, labels=[k for k, _ in s.labels])
                fam.add_metric([v for _, v in s.labels], s.value)
            yield from families.values()

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector())

    def authorized(request: Request) -> bool:
        if not srv.api_key:
            return True
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), srv.api_key.encode())

    def check_auth(request: Request) -> None:
        if not authorized(request):
            raise ApiError(401, "Incorrect or missing API key: pass 'Authorization: Bearer <key>'",
                           code="invalid_api_key", kind="authentication_error")

    async def read_json(request: Request) -> dict:
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > srv.max_body_bytes):
            raise ApiError(413, f"request body exceeds {srv.max_body_bytes} bytes")
        raw = bytearray()
        try:
            async for part in request.stream():
                raw += part
                if len(raw) > srv.max_body_bytes:
                    raise ApiError(413, f"request body exceeds {srv.max_body_bytes} bytes")
        except ClientDisconnect:
            raise ApiError(400, "the client disconnected before the body was read") from None
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str):
            raise ApiError(400, "'model' is required: a string naming the served model", "model")
        if model != srv.model:
            raise ApiError(404, f"The model '{model}' does not exist: this server serves '{srv.model}'", "model",
                           code="model_not_found")
        return body

    async def generate(request: Request, chat: bool):
        try:
            check_auth(request)
            body = await read_json(request)
            parse = parse_chat if chat else parse_completion
            g = parse(body, srv.default_temperature)
            chunks, cancelled = await srv.start(g)
        except ApiError as e:
            return _error(e)
        rid = new_id(chat)
        if g.stream:
            return StreamingResponse(_sse(request, chunks, cancelled, rid, chat, g.include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _whole(request, chunks, cancelled, rid, chat)

    async def _whole(request: Request, chunks: asyncio.Queue, cancelled: threading.Event, rid: str, chat: bool):
        watcher = asyncio.ensure_future(_disconnected(request))
        text, last = [], None
        try:
            while last is None or not last.finished:
                last = await _next(chunks, watcher)
                if last is None:  # the client went away: its row is freed at the next step
                    return Response(status_code=499)
                text.append(last.text)
        finally:
            watcher.cancel()
            if last is None or not last.finished:
                cancelled.set()
        if last.error:
            return _error(ApiError(500, f"generation failed: {last.error}", kind="server_error"))
        return JSONResponse(completion_body(rid, srv.model, chat, "".join(text), last.finish_reason, last.stats))

    async def _sse(request: Request, chunks: asyncio.Queue, cancelled: threading.Event, rid: str, chat: bool,
                   include_usage: bool):
        created = int(time.time())
        watcher = asyncio.ensure_future(_disconnected(request))

        def event(obj) -> str:
            return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

        done = False
        try:
            if chat:
                yield event(chunk_body(rid, srv.model, chat, created, "", None, role=True, with_usage=include_usage))
            while not done:
                c = await _next(chunks, watcher)
                if c is None:  # the client went away
                    return
                done = c.finished
                if c.error:
                    yield event(ApiError(500, f"generation failed: {c.error}", kind="server_error").body())
                    break
                if c.text:
                    yield event(chunk_body(rid, srv.model, chat, created, c.text, None, with_usage=include_usage))
                if c.finished:
                    yield event(chunk_body(rid, srv.model, chat, created, None if chat else "", c.finish_reason,
                                           with_usage=include_usage))
                    if include_usage and c.stats is not None:
                        yield event(usage_chunk(rid, srv.model, chat, created, c.stats))
            yield "data: [DONE]\n\n"
        finally:  # the stream ended, or the client went away (seen by the watcher, or this task is cancelled)
            watcher.cancel()
            if not done:
                cancelled.set()

    async def completions(request: Request):
        return await generate(request, chat=False)

    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    async def models(request: Request):
        try:
            check_auth(request)
        except ApiError as e:
            return _error(e)
        return JSONResponse({"object": "list", "data": [
            {"id": srv.model, "object": "model", "created": srv.created, "owned_by": "specexport",
             "max_model_len": srv.dec.config.max_seq_len}]})

    async def health(request: Request):
        alive = srv.batcher.alive
        return JSONResponse({"status": "ok" if alive else "stopped"}, status_code=200 if alive else 503)

    async def metrics(request: Request):
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def http_error(request: Request, exc: HTTPException):  # 404 / 405 in OpenAI's shape
        return _error(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                               kind="invalid_request_error"))

    async def internal_error(request: Request, exc: Exception):
        return _error(ApiError(500, f"internal error: {type(exc).__name__}", kind="server_error"))

    routes = [Route("/v1/models", models, methods=["GET"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"])]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: internal_error})


SWITCH_INTERVAL = 0.0002  # seconds; Python's default is 0.005


def set_switch_interval() -> float:
    """The engine thread returns from every ONNX Runtime call (which runs without the GIL) needing the GIL back;
    while the event loop holds it, the thread waits up to the interpreter's switch interval. A speculative step
    makes k + 1 such calls (the fused draft runs one pass per call), target-only one, so under load the default
    5 ms penalizes speculation. genai-perf, SmolLM2 engines/load16, spec(auto)/target-only output throughput at
    16 clients: 0.96, 1.10, 1.18, 1.00 with 0.2 ms against 1.00, 1.01, 0.90 with 5 ms (one session, alternating;
    no difference at 1 and 4 clients). SPECEXPORT_SWITCH_INTERVAL overrides it."""
    value = float(os.environ.get("SPECEXPORT_SWITCH_INTERVAL") or SWITCH_INTERVAL)
    sys.setswitchinterval(value)
    return value


def serve(engine_dir: str, host: str = "127.0.0.1", port: int = 8000, k: int | str | None = "auto",
          max_batch: int | None = None, api_key: str | None = None, threads: int | None = None,
          prepack: bool | None = None, max_waiting: int = 64, model_name: str | None = None,
          speculative: bool = True, log_level: str = "info") -> None:
    """Load the engine folder and serve it until interrupted."""
    import uvicorn
    set_switch_interval()
    options = {"max_batch": max_batch, "threads": threads, "prepack": prepack,
               "preload": True}  # every session before the first request: no pause opening one under load
    dec = SpeculativeDecoder.load(engine_dir, **{n: v for n, v in options.items() if v is not None})
    srv = OpenAIServer(dec, model_name or Path(engine_dir).resolve().name, k=k, speculative=speculative,
                       max_waiting=max_waiting, api_key=api_key or os.environ.get(API_KEY_ENV) or None)
    try:
        uvicorn.run(srv.app, host=host, port=port, log_level=log_level)
    finally:
        srv.close()
