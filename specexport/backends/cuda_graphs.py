"""CUDA-graph capture of the hot steps (draft, verify) for the torch and pt2 engines.

An engine with `capture_steps()` (backends/torch_engine.py) sends its draft and verify calls here instead of
running the step module eagerly; prefill stays eager (chunked, once per request, and called at any row0).

Per engine call (`StepGraphs.run`):
1. Key: (graph name, batch bucket Bb, which optional inputs are None). Buckets are the powers of two below
   max_batch, and max_batch: a call with B rows runs the smallest bucket >= B over cache rows 0..Bb-1. Rows
   B..Bb-1 repeat row 0's inputs; they are free rows of the batch (batch.py steps rows 0..hi-1), so what they
   compute and write into their own cache rows is padding that nothing reads.
2. First call of a key (`StepGraph`): static input buffers [Bb, ...] on the device (plus pinned host staging
   buffers), the first call's inputs copied in, `warmup` eager runs on a side stream, then capture on the same
   side stream (torch.cuda.graph(graph, pool=shared, stream=side)). All graphs of an engine share one memory pool.
   Warm-up and replay write the same cache positions with the same values (a step only reads cache positions it
   wrote earlier in the same run, or committed ones), so running the first call's step several times is harmless.
3. Every call: inputs -> pinned host buffers -> static device buffers (one async copy each), replay, static
   outputs -> pinned host buffers (async), then one host sync (the only one of the call). A step with a model
   drafter makes two calls (draft, verify), so it syncs twice; a prompt-lookup step syncs once.
   The sampling draft's q [B, k, V] still makes a host round trip between the two calls (the Engine protocol
   speaks numpy); greedy steps have no q.

Uniforms: by default each call copies in the host's uniforms like any other input: they come from each
request's own stream (sampling.row_stream), so a request's seed gives the same tokens on every call, in any
batch, as on the CPU backends (up to the device's rounding of the probabilities). With `device_uniforms=True`
(StepGraphs / capture_steps) the captured callable draws its own `u` from a device torch.Generator registered
with the graph (`CUDAGraph.register_generator_state`), so each replay advances the generator's offset instead of
repeating the numbers baked in at capture, and the host's uniforms are ignored: a seed then belongs to the
engine (`seed`), not to a request, and a request's tokens depend on what ran before it. Each engine role draws
its own stream (`stream_seed`): the draft's u picks its tokens and the target's u accepts them, and two
generators seeded alike give the same numbers at the same flat positions (Philox: the same offsets too, when
both graphs advance alike), so at batch 1 a draft token would be tested with the u that chose it (stop 42 found
this on an H200: chi-square p = 1.4e-5). SpeculativeDecoder refuses a pair that shares a stream
(`check_streams`). Device uniforms save one copy of B x (k + 1) floats per call.

Testing without a GPU: `FakeRuntime` implements the same device interface on CPU: streams are None, capture
records the callable and runs it once, replay runs it again over the same static buffers and copies the results
into the outputs recorded at capture (as a graph writes its outputs at fixed addresses). With `check=True` the
runner also (a) clones each caller input before copy-in and poisons the clone and the host staging buffer after
it, so a callable that read anything but the static buffers gives wrong tokens, (b) asserts that every tensor
the step receives is one of the static buffers or the cache rows, and (c) asserts that outputs and static inputs
keep their storage (data_ptr) on every replay. tests/test_cuda_graphs.py drives the engines through it.

What only a GPU run can show (tests marked `gpu`, tools/gpu_selftest.py): that capture is legal for these steps
(no host sync, no CPU tensor, no data-dependent shape inside the captured region; e.g. `process_logits` must
run with `filter=True`, which the captured steps are built with); that the replayed kernels give the eager
tokens; that the registered generator really advances between replays; replay timing and host overhead; and
whether AOTInductor's pt2 runner (its own stream and allocations) captures cleanly.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import numpy as np
import torch

POISON = -7  # what check mode writes over the caller's copies of the inputs after copy-in


STREAMS = ("target", "draft")  # one device-uniform stream per engine role


def stream_seed(seed: int, role: str) -> int:
    """The device generator's seed of engine `role` under the engine seed `seed`: distinct for every (seed, role)."""
    if role not in STREAMS:
        raise ValueError(f"role {role!r}: choose one of {STREAMS}")
    return seed * len(STREAMS) + STREAMS.index(role)


def check_streams(target: "StepGraphs", draft) -> None:
    """Both engines draw device uniforms: they must draw independent streams (module docstring, Uniforms).
    draft: the draft engine's StepGraphs, or anything else (None, another backend's graphs) when it has none."""
    if target.generator is None or getattr(draft, "generator", None) is None:
        return
    if target.generator_seed == draft.generator_seed:
        from ..errors import SpecExportError
        raise SpecExportError(f"the target's and the draft's CUDA graphs draw the same uniforms (generator seed "
                              f"{target.generator_seed}), which would bias sampling: capture the draft with "
                              "capture_steps(role='draft')")


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """Powers of two below max_batch, and max_batch: 8 -> (1, 2, 4, 8); 6 -> (1, 2, 4, 6)."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return (*out, max_batch)


class CudaRuntime:
    """The real device API (needs CUDA): side streams, warm-up, torch.cuda.CUDAGraph capture, pinned buffers."""

    device_uniforms = False  # the host's per-request uniforms (module docstring, Uniforms)

    def __init__(self, device: torch.device | str = "cuda"):
        self.device = torch.device(device)
        self.pool = torch.cuda.graph_pool_handle()  # one pool for all of an engine's graphs (replayed in turn)

    def side_stream(self):
        return torch.cuda.Stream(self.device)

    def warm_up(self, fn: Callable, stream, times: int) -> None:
        main = torch.cuda.current_stream(self.device)
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            for _ in range(times):
                fn()
        main.wait_stream(stream)

    def capture(self, fn: Callable, stream, generator: torch.Generator | None):
        """-> (replay, outputs): the outputs are the tensors the graph writes on every replay."""
        graph = torch.cuda.CUDAGraph()
        if generator is not None:  # replays advance its philox offset (torch >= 2.4)
            graph.register_generator_state(generator)
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            out = fn()
        return graph.replay, out

    def generator(self, seed: int) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        return g

    def host_buffer(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def sync(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()

    def timer(self):
        return _CudaTimer(self.device)


class FakeRuntime:
    """The device API on CPU, for tests: capture records the callable (and runs it once), replay runs it again
    over the same static buffers and writes the results into the outputs recorded at capture."""

    device = torch.device("cpu")

    def __init__(self, device_uniforms: bool = False):
        self.device_uniforms = device_uniforms
        self.captures = 0
        self.replays = 0

    def side_stream(self):
        return None

    def warm_up(self, fn, stream, times):
        for _ in range(times):
            fn()

    def capture(self, fn, stream, generator):
        out = fn()
        self.captures += 1

        def replay():
            self.replays += 1
            for o, n in zip(out, fn()):
                if o is not n:
                    o.copy_(n)
        return replay, out

    def generator(self, seed):
        g = torch.Generator()
        g.manual_seed(seed)
        return g

    def host_buffer(self, shape, dtype):
        return torch.empty(shape, dtype=dtype)

    def sync(self):
        pass

    def timer(self):
        return _WallTimer()


class _CudaTimer:
    """Device time of the replays (CUDA events around each one), read after the call's sync."""

    def __init__(self, device):
        self.device, self.pairs, self.total_ms = device, [], 0.0

    @contextlib.contextmanager
    def span(self):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(torch.cuda.current_stream(self.device))
        yield
        b.record(torch.cuda.current_stream(self.device))
        self.pairs.append((a, b))

    def collect(self):  # after a sync: every recorded pair has completed
        self.total_ms += sum(a.elapsed_time(b) for a, b in self.pairs)
        self.pairs.clear()


class _WallTimer:
    def __init__(self):
        self.total_ms = 0.0

    @contextlib.contextmanager
    def span(self):
        import time
        t0 = time.perf_counter()
        yield
        self.total_ms += (time.perf_counter() - t0) * 1e3

    def collect(self):
        pass


class StepGraph:
    """One captured step for one (graph, batch bucket): static inputs, the replay, static outputs.

    inputs: the first call's inputs ([B, ...] CPU tensors from numpy, device tensors, or None for absent
    optional inputs); batched[i]: input i has the batch dimension (key_pos has not); kv: the cache rows
    0..Bb-1 (views of the engine's caches); u_index: the position of `u` when the device draws it."""

    def __init__(self, runtime, step: Callable, inputs: Sequence, batched: Sequence[bool], kv: list[torch.Tensor],
                 n_out: int, u_index: int | None = None, generator: torch.Generator | None = None,
                 warmup: int = 2, check: bool = False, timer=None):
        self.rt, self.check, self.timer = runtime, check, timer
        self.Bb = int(kv[0].shape[0])
        self.batched = list(batched)
        self.u_index = u_index if generator is not None else None
        dev = runtime.device
        self.static = [None if x is None else torch.empty(self._shape(x, b), dtype=x.dtype, device=dev)
                       for x, b in zip(inputs, self.batched)]
        # pinned staging for host inputs (device-resident inputs are copied device to device)
        self.host_in = [None if x is None or x.device.type != "cpu" else runtime.host_buffer(self._shape(x, b), x.dtype)
                        for x, b in zip(inputs, self.batched)]
        self.copy_in(inputs)
        bound = self._bound(inputs)  # what the captured callable reads
        allowed = {t.data_ptr() for t in self.static if t is not None} | {t.data_ptr() for t in kv}

        def run():
            if self.u_index is not None:  # the device draws this call's uniforms (advanced on every replay)
                u = bound[self.u_index]
                torch.rand(u.shape, generator=generator, dtype=u.dtype, device=u.device, out=u)
            args = (*bound, *kv)
            if check:  # the step receives only static buffers and cache rows
                bad = [i for i, a in enumerate(args) if a is not None and a.data_ptr() not in allowed]
                assert not bad, f"the captured step reads inputs {bad} from outside the static buffers"
            return list(step(*args)[:n_out])

        stream = runtime.side_stream()
        runtime.warm_up(run, stream, warmup)
        self.replay, self.outputs = runtime.capture(run, stream, generator)
        self.host_out = [runtime.host_buffer(tuple(o.shape), o.dtype) for o in self.outputs]
        self.ptrs = self._ptrs()

    def _shape(self, x: torch.Tensor, batched: bool) -> tuple[int, ...]:
        return (self.Bb, *x.shape[1:]) if batched else tuple(x.shape)

    def _bound(self, inputs) -> list:
        """The tensors the captured callable passes to the step: the static buffers (a test replaces this to
        show that the check catches a callable bound to the caller's tensors)."""
        return self.static

    def _ptrs(self) -> list[int]:
        return [t.data_ptr() for t in self.static + self.outputs if t is not None]

    def copy_in(self, inputs) -> None:
        """Caller inputs [B, ...] -> static buffers [Bb, ...] (rows B.. repeat row 0), one async copy each."""
        B = next(int(x.shape[0]) for x, b in zip(inputs, self.batched) if b and x is not None)
        assert B <= self.Bb
        for i, (x, s, h, b) in enumerate(zip(inputs, self.static, self.host_in, self.batched)):
            if s is None or i == self.u_index:
                continue
            assert (x.shape[1:] if b else x.shape) == (s.shape[1:] if b else s.shape), \
                f"input {i}: {tuple(x.shape)} does not fit the static {tuple(s.shape)}"
            if h is not None:
                (h[:B] if b else h).copy_(x)
                if b and B < self.Bb:
                    h[B:].copy_(h[:1].expand(self.Bb - B, *h.shape[1:]))
                s.copy_(h, non_blocking=True)
            else:
                (s[:B] if b else s).copy_(x)
                if b and B < self.Bb:
                    s[B:].copy_(s[:1].expand(self.Bb - B, *s.shape[1:]))
            if self.check:  # (StepGraphs passes copies of the caller's inputs in check mode)
                self.rt.sync()  # the copies have landed: poison the inputs given and the staging buffer
                x.fill_(POISON)
                if h is not None:
                    h.fill_(POISON)

    def __call__(self, inputs, B: int, copy_in: bool = True) -> list[np.ndarray]:
        """Copy in (unless the capture just did), replay, copy out, sync -> the outputs [B, ...] as numpy."""
        if copy_in:
            self.copy_in(inputs)
        if self.timer is not None:
            with self.timer.span():
                self.replay()
        else:
            self.replay()
        for h, o in zip(self.host_out, self.outputs):
            h.copy_(o, non_blocking=True)
        self.rt.sync()  # the one host sync of this call
        if self.timer is not None:
            self.timer.collect()
        if self.check:
            assert self._ptrs() == self.ptrs, "a static buffer or output changed storage between replays"
        return [(h.float() if h.is_floating_point() and h.dtype != torch.float32 else h)[:B].numpy()
                for h in self.host_out]


class StepGraphs:
    """An engine's captured steps, keyed by (graph name, batch bucket, None pattern of the optional inputs).

    runtime: CudaRuntime (real graphs) or FakeRuntime (CPU tests); seed, role: the device generator's (used when
    the runtime draws uniforms on the device; stream_seed); warmup: eager runs on the side stream before each
    capture; check: the harness checks (see the module docstring); time_replays: sum the device time of the
    replays into `device_ms` (CUDA events; wall time under FakeRuntime)."""

    def __init__(self, runtime, max_batch: int, seed: int = 0, role: str = "target", warmup: int = 2,
                 check: bool = False, device_uniforms: bool | None = None, time_replays: bool = False):
        self.rt = runtime
        self.buckets = batch_buckets(max_batch)
        self.warmup, self.check = warmup, check
        self.device_uniforms = runtime.device_uniforms if device_uniforms is None else device_uniforms
        self.generator_seed = stream_seed(seed, role)
        self.generator = runtime.generator(self.generator_seed) if self.device_uniforms else None
        self.timer = runtime.timer() if time_replays else None
        self.graphs: dict[tuple, StepGraph] = {}

    @property
    def device_ms(self) -> float:
        return 0.0 if self.timer is None else self.timer.total_ms

    def bucket(self, B: int) -> int:
        for b in self.buckets:
            if b >= B:
                return b
        raise ValueError(f"batch {B} exceeds max_batch {self.buckets[-1]}")

    def run(self, name: str, names: Sequence[str], step: Callable, inputs: Sequence, kv_rows: Callable[[int], list],
            n_out: int) -> list[np.ndarray]:
        """One call of graph `name`: names are its inputs' names (io_names, caches excluded), inputs the
        caller's tensors (or None), kv_rows(Bb) the cache rows 0..Bb-1; returns the n_out outputs, [B, ...]."""
        if self.check:  # copy_in poisons what it is given after copying it: never the caller's own arrays
            inputs = [None if x is None else x.clone() for x in inputs]
        batched = [n != "key_pos" for n in names]
        B = int(inputs[0].shape[0])
        Bb = self.bucket(B)
        key = (name, Bb, tuple(x is None for x in inputs))
        g = self.graphs.get(key)
        if g is not None:
            return g(inputs, B)
        u_index = names.index("u") if "u" in names else None
        g = StepGraph(self.rt, step, inputs, batched, kv_rows(Bb), n_out, u_index,
                      self.generator if u_index is not None else None, self.warmup, self.check, self.timer)
        self.graphs[key] = g
        return g(inputs, B, copy_in=False)  # the capture copied this call's inputs in
