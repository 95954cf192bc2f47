"""One step graph of an OrtEngine at one batch size: its IOBinding, made on first use. Outputs are bound to
preallocated buffers and inputs copied into preallocated values (`update_inplace` on CUDA), so a step allocates
nothing of its own; the cache rows are bound as both input and output, so ONNX Runtime writes them in place."""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING

import numpy as np

from ..graphs import row_cache_name
from . import ort_capi

if TYPE_CHECKING:
    from .ort_engine import OrtEngine


class Binding:
    """One step graph at one batch size: its IOBinding, its input OrtValues and its output buffers."""

    def __init__(self, eng: OrtEngine, name: str, B: int, row0: int, graph_id: int):
        ort = eng.ort
        # the engine holds its bindings: a weak reference back, so that freeing a decoder frees its sessions and
        # packed weights at once (a cycle waited for a garbage collection)
        self.eng, self.name, self.B = weakref.proxy(eng), name, B
        self.sess = eng.session(name)
        self.io = self.sess.io_binding()
        spec = eng.graphs[name]
        base = eng.graphs[spec["of"]] if spec.get("rows") else spec  # a per-row variant takes its graph's inputs
        n_kv = 2 * eng.config.num_layers
        dev = "cuda" if eng.device == "cuda" else "cpu"
        self.on_cuda = dev == "cuda"
        cfg = eng.config
        kv_shape = [B, cfg.num_kv_heads, eng.cache_len, cfg.head_dim]

        self.capi = eng.capi

        def value(host: np.ndarray, output: bool = False):  # a value over host (on cuda: a device copy)
            if self.capi:
                return ort_capi.Value(host, writeable=output)
            if dev == "cuda":
                return ort.OrtValue.ortvalue_from_numpy(host, "cuda", 0)
            return ort.OrtValue.ortvalue_from_numpy(host)

        bind_in, bind_out = ((self.io.bind_input, self.io.bind_output) if self.capi
                             else (self.io.bind_ortvalue_input, self.io.bind_ortvalue_output))
        row_bytes = int(np.prod(kv_shape[1:])) * eng.kv_dtype.itemsize  # rows row0.. of [max_batch, Hkv, S, D]
        # the caches come last: n_kv of [B, Hkv, S, D], or in a per-row variant B of [1, Hkv, S, D] per cache,
        # `key.{layer}.{row}` (rows inner): each bound to its cache rows, as both input and output
        caches = [(i[0], o[0]) for i, o in zip(base["inputs"][-n_kv:], base["outputs"][-n_kv:])]
        parts = [(row_cache_name(i, r), row_cache_name(o, r), j, row0 + r, 1) for j, (i, o) in enumerate(caches)
                 for r in range(B)] if spec.get("rows") else [(i, o, j, row0, B) for j, (i, o) in enumerate(caches)]
        for i_name, o_name, j, first, n in parts:
            if self.capi:  # the cache rows as both input and output: written in place
                rows = value(eng._kv_np[j][first:first + n], output=True)
                bind_in(i_name, rows)
                bind_out(o_name, rows)
                continue
            ptr = eng.kv[j].data_ptr() + first * row_bytes
            self.io.bind_input(i_name, dev, 0, eng.kv_dtype, [n] + kv_shape[1:], ptr)
            self.io.bind_output(o_name, dev, 0, eng.kv_dtype, [n] + kv_shape[1:], ptr)
        self.keep = []  # OrtValues bound once must outlive the binding
        self.inputs = {}  # name -> (OrtValue, host staging array) for the step's small inputs, key_pos aside
        for i_name, dtype, dims in base["inputs"][:-n_kv]:
            if i_name == "key_pos":
                continue
            host = np.zeros([B if d == "B" else d for d in dims], np.dtype(dtype))
            v = value(host)
            bind_in(i_name, v)
            self.inputs[i_name] = (v, host)
        self.outputs = []  # (OrtValue, host array) per step output, in the step's order
        for o_name, dtype, dims in base["outputs"][:-n_kv]:
            shape = [B if d == "B" else d for d in dims]
            host = np.zeros(shape, np.dtype(dtype))
            v = ort.OrtValue.ortvalue_from_shape_and_type(shape, np.dtype(dtype), "cuda", 0) if dev == "cuda" \
                else value(host, output=True)
            bind_out(o_name, v)
            self.outputs.append((v, host))
        if self.capi:
            self._call = self.io.run
            return
        self.run_options = ort.RunOptions()
        # on CPU the C++ call directly: the Python wrapper's graph-capture checks cost ~0.1 ms per run (an
        # exception from get_run_config_entry when gpu_graph_id is unset), 1-2% of a small model's step
        c_sess, c_io = getattr(self.sess, "_sess", None), getattr(self.io, "_iobinding", None)
        sess, io, ro = self.sess, self.io, self.run_options  # (locals, not self: no reference cycle)
        self._call = (lambda: c_sess.run_with_iobinding(c_io, ro)) if dev == "cpu" and c_sess \
            and c_io is not None else (lambda: sess.run_with_iobinding(io, ro))
        if dev == "cuda":
            self.run_options.add_run_config_entry("gpu_graph_id", str(graph_id))
            self._bind_once("key_pos", eng.key_pos, value)  # full S: every replay has the same shapes

    def _bind_once(self, name: str, host: np.ndarray, value) -> None:
        v = value(host)
        self.io.bind_ortvalue_input(name, v)
        self.keep.append((v, host))

    def run(self, inputs: dict, kv_len: int) -> list[np.ndarray]:
        missing = set(self.inputs) - set(inputs)  # (an input the step does not read was pruned by the export)
        assert not missing, f"{self.name}: inputs {sorted(missing)} not given"
        for name, (value, host) in self.inputs.items():
            arr = inputs[name]
            if arr.shape != host.shape:
                raise AssertionError(f"{self.name}: input {name} has shape {arr.shape}, the graph takes {host.shape}")
            if self.on_cuda:
                value.update_inplace(np.ascontiguousarray(arr, dtype=host.dtype))
            else:
                np.copyto(host, arr, casting="same_kind")
        if self.capi:  # attention reads only the first kv_len cache positions
            self.io.bind_input("key_pos", self.eng.key_pos_value(kv_len))
        elif not self.on_cuda:
            self.io.bind_input("key_pos", "cpu", 0, np.int64, [kv_len], self.eng.key_pos.ctypes.data)
        t0 = time.perf_counter()
        self._call()
        self.eng.busy_s += time.perf_counter() - t0
        if self.on_cuda:
            return [v.numpy() for v, _ in self.outputs]
        return [host for _, host in self.outputs]
