"""Continuous batching for services: concurrent requests share one SpeculativeDecoder.

A request joins the running batch at a step boundary, prefilled in a free cache row at its own position;
a finished request frees its row for the next waiting one. The waiting queue is bounded: `submit` blocks
while it is full (back-pressure), so a request over capacity waits and never fails for lack of room.
One thread owns the engines; callbacks run on it and must be quick (hand the data to a sender).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

from ..config import SamplingParams
from ..errors import SpecExportError
from ..batch import Batch
from ..request import GenerationStats, Request
from ..runtime import SpeculativeDecoder
from .metrics import SpecMetrics


@dataclass
class Chunk:
    """What one step added to one request."""

    token_ids: list[int]
    text: str  # the visible text those tokens add (stop strings and incomplete characters held back)
    finished: bool
    finish_reason: str | None = None
    stats: GenerationStats | None = None  # on the final chunk
    error: str | None = None  # the engine failed while this request ran (it is finished)


class QueueFull(SpecExportError):
    """submit(block=False) found the waiting queue full (a server answers 429 and the client retries)."""


class ContinuousBatcher:
    def __init__(self, dec: SpeculativeDecoder, speculative: bool = True, k: int | str | None = None,
                 max_waiting: int = 256):
        self.dec = dec
        self.k = dec._k(k)
        self.speculative = speculative
        self.batch = Batch(dec, speculative, self.k)
        self.waiting: queue.Queue = queue.Queue(maxsize=max_waiting)
        self._texts: dict[int, str] = {}
        self._callbacks: dict[int, Callable[[Chunk], None]] = {}  # by id(request), admitted and not finished
        self._requests: dict[int, Request] = {}
        self._cancelled: dict[int, Callable[[], bool]] = {}  # by id(request), for those that can be cancelled
        self.metrics = SpecMetrics()  # counted as requests finish (metrics.py); the gauges read at export
        self.metrics.gauges = {"num_requests_running": lambda: len(self.batch.rows()),
                               "num_requests_waiting": self.waiting.qsize}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="specexport-batcher", daemon=True)
        self._thread.start()

    def submit(self, prompt, on_chunk: Callable[[Chunk], None], max_new_tokens: int = 128,
               sampling: SamplingParams | None = None, chat: bool = False, stop: Sequence[str] = (),
               stop_token_ids: Sequence[int] = (), is_cancelled: Callable[[], bool] | None = None,
               block: bool = True, ignore_eos: bool = False) -> None:
        """Check the request (a bad one raises SpecExportError here, before it queues), then queue it.
        is_cancelled: polled at step boundaries; a cancelled request leaves the batch (finish_reason
        'cancelled') and frees its row. block=False: a full queue raises QueueFull instead of waiting.
        ignore_eos: the model's EOS tokens do not end the request (fixed-length benchmarks)."""
        if not self.alive:
            raise SpecExportError("the batcher has stopped: restart the model")
        req = self.dec._prepare([prompt], max_new_tokens, sampling, chat, stop_token_ids, stop, ignore_eos)[0]
        if is_cancelled is not None:
            self._cancelled[id(req)] = is_cancelled
        while True:  # blocks while the queue is full (back-pressure), but not past close()
            if self._stop.is_set():
                self._cancelled.pop(id(req), None)
                raise SpecExportError("the batcher is closing: the request was not queued")
            try:
                self.waiting.put((req, on_chunk), timeout=0.1 if block else None, block=block)
                return
            except queue.Full:
                if not block:
                    self._cancelled.pop(id(req), None)
                    raise QueueFull(f"the queue is full ({self.waiting.maxsize} requests waiting): retry later") \
                        from None

    @property
    def alive(self) -> bool:
        """The serving thread runs (a server's health)."""
        return self._thread.is_alive()

    def close(self) -> None:
        """Stop the serving thread; running and queued requests get a final error chunk."""
        self._stop.set()
        self._thread.join(timeout=30)
        self._fail_all("the model is shutting down")
        while True:
            try:
                req, cb = self.waiting.get_nowait()
            except queue.Empty:
                break
            self.metrics.observe(req.stats, "error")
            _call(cb, Chunk([], "", True, "error", req.stats, error="the model is shutting down"))

    # ---- the serving thread --------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._admit()
                self._drop_cancelled()
                if not self.batch.rows():
                    continue
                self._dispatch(self.batch.step())
            except Exception as e:  # an engine failure: fail the running requests, keep serving the others
                self._fail_all(f"{type(e).__name__}: {e}")

    def _admit(self) -> None:
        free = self.batch.free_rows()
        new: list[tuple[Request, Callable]] = []
        block = not self.batch.rows()  # idle: wait for work instead of spinning
        while len(new) < len(free):
            try:
                new.append(self.waiting.get(block=block and not new, timeout=0.05))
            except queue.Empty:
                break
        live = []
        for req, cb in new:  # cancelled while queued: answered, never admitted
            if self._is_cancelled(req):
                self._cancelled.pop(id(req), None)
                req.finish_reason = "cancelled"
                self.metrics.observe(req.stats, "cancelled")
                _call(cb, Chunk([], "", True, "cancelled", req.stats))
            else:
                live.append((req, cb))
        new = live
        if not new:
            return
        for req, cb in new:
            self._callbacks[id(req)] = cb
            self._texts[id(req)] = ""
            self._requests[id(req)] = req
        self._dispatch(self.batch.admit(free[:len(new)], [r for r, _ in new]))

    def _is_cancelled(self, req: Request) -> bool:
        check = self._cancelled.get(id(req))
        try:
            return bool(check()) if check is not None else False
        except Exception:
            return False

    def _drop_cancelled(self) -> None:
        """Requests whose client went away leave the batch at this step boundary; their rows are free."""
        for b in self.batch.rows():
            req = self.batch.reqs[b]
            if self._is_cancelled(req):
                self.batch._release(b)
                req.finish_reason = "cancelled"
                self._dispatch([(req, [])])

    def _dispatch(self, events: list[tuple[Request, list[int]]]) -> None:
        for req, taken in events:
            key = id(req)
            text = ""
            if self.dec.tokenizer is not None:
                shown = req.visible_text()
                text, self._texts[key] = shown[len(self._texts[key]):], shown
            done = req.finish_reason is not None
            cb = self._callbacks[key] if not done else self._callbacks.pop(key)
            if done:
                self._texts.pop(key, None)
                self._requests.pop(key, None)
                self._cancelled.pop(key, None)
                self.metrics.observe(req.stats, req.finish_reason)
            _call(cb, Chunk(taken, text, done, req.finish_reason, req.stats if done else None))

    def _fail_all(self, message: str) -> None:
        """Every admitted request not yet finished gets a final error chunk; the batch starts empty again."""
        for b in self.batch.rows():
            self.batch._release(b)
        for key, cb in list(self._callbacks.items()):
            req = self._requests.pop(key, None)
            self._callbacks.pop(key, None)
            self._texts.pop(key, None)
            self._cancelled.pop(key, None)
            self.metrics.observe(req.stats if req else None, "error")
            _call(cb, Chunk([], "", True, "error", req.stats if req else None, error=message))


def _call(cb: Callable[[Chunk], None], chunk: Chunk) -> None:
    try:
        cb(chunk)
    except Exception:  # a client's callback must not take the batch down
        pass
