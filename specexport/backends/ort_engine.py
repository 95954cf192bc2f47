"""The onnxruntime backend: the exported step graphs over IOBinding, caches updated in place.

- Weights: `weights.safetensors` is memory-mapped once (ort_memory.py) and every tensor becomes one OrtValue
  that all of the model's sessions (one per step graph) share through SessionOptions.add_initializer: the
  weights are in memory once, however many graphs the model has.
- MLAS pre-packing (`prepack`, default on where the C API loads; quantized layers, MatMulNBits, always pre-pack, an
  fp32 target's certified head included: about 150x slower without) makes multi-token passes (verify over k+1,
  prefill chunks) cost little more than a one-token pass. On the CPU, pre-packing sessions are made through ONNX
  Runtime's C API (ort_capi.py) with one pre-packed weights container per process, so every step graph of every
  engine reads one packed copy of each weight (the Python API has no container: there each session packed its own,
  one copy per graph). Once the sessions have packed, the mapped file's pages go back to the page cache, so a run
  holds the packed copy and not the unpacked original as well. Without pre-packing (prepack=False, or the Python API
  fallback SPECEXPORT_ORT_CAPI=0), every session reads the mapped weights as they are. The greedy graphs' sessions
  open at load and the sampling graphs' at their first use (`preload=True`: all at load, per-row variants included,
  as the servers load; False: each at first use).
- KV: one preallocated buffer per layer for keys and values, [max_batch, Hkv, S, D], over one anonymous
  memory map per engine (resident as positions are written); a call with batch B binds rows 0..B-1 as both
  the graph's cache input and its cache output, so ONNX Runtime writes the new keys and values in place
  (ScatterElements skips its copy when input and output are one buffer). A fused draft of the target's own
  layers (a quantized copy, or a `layers:` draft over the buffers of the target layers it keeps) runs over the
  target's buffers and has none of its own (share_kv; drafters.ModelDrafter.link_kv).
- Per (graph, batch) one IOBinding, made on first use (ort_binding.py): outputs bound to preallocated
  buffers, inputs copied into preallocated OrtValues (`update_inplace`), so a step allocates nothing of its own.
- Graph sets: "portable" (standard ops) or "fused" (ONNX Runtime's fused ops, models/ort_ops.py; the build's
  default). Fused graphs write the caches inside GroupQueryAttention, whose CPU kernel takes multi-token rows
  with a past only at batch 1. A fused target's verify graphs therefore have per-row-attention variants
  (`<graph>_rows<B>`, B = 2..16, manifest entries {"of", "rows"}; export/onnx_graphs.per_row_attention): one
  call over all rows whose attention runs per row, its caches bound row by row (`key.{layer}.{row}`); a larger
  batch runs in chunks of 16, and a graph without variants (prefill chunks, an engine built before them) row by
  row. A fused draft has one graph per pass (draft_pass1/2), chained here: k calls, each feeding the token the
  previous one drafted.
- Exact target-only steps (fused): ONNX Runtime's GroupQueryAttention computes a one-token pass with another
  kernel than a multi-token pass (they round differently; every row count >= 2 agrees bit for bit), so a
  1-token target step could differ from the same position verified in a k+1-token pass after a near tie. At
  batch 1 the target-only step is therefore `verify_k0_exact`: 1-row linears, attention over the current token
  twice, the second row dropped; speculative output equals target-only output token for token. That needs the
  linears to round one row as they round it among others, which depends on the CPU: on an AVX2 CPU without
  AVX-512 a 4-bit MatMulNBits runs one row through another kernel (1e-6 apart; seen flipping a greedy token of
  the default Q4_1 engine at k=auto), and so does an unpacked fp32 linear on most x86 CPUs (prepack=False:
  2e-5 apart). The first target-only step probes the engine's quantized formats and its fp32 linears under its
  pre-packing (backends/row_probe.py); where one row differs, batch-1 target-only steps run `verify_k1` (2 rows;
  the build adds it to every fused target with quantized linears; else the narrowest built k's verify; the
  portable graph set too) over the current token twice with no drafts: 1.13x a
  `verify_k0_exact` step for the Q4_1 SmolLM2 on that CPU (the smallest built k's verify, which older engines
  fall back to, costs 1.33-1.45x). Since that step is a k = 1 verify anyway (or the narrowest built k's), that k
  is then a step width too (`free_ks`, added to the runtime's built_ks): its draft tokens ride in it at no cost.
  Batched target-only steps (B > 1) are the batched 1-token graph, unless `batch_invariant`: then they are the
  exact step's per-row variant, and a request's tokens never depend on its batch (README: exactness).
- CUDA (onnxruntime-gpu): the same, with the KV and the step inputs and outputs on the device,
  `enable_cuda_graph` and one gpu_graph_id per (graph, batch); key_pos is then always the full S so that
  every replay has the same shapes. The provider copies the shared host weights into each session, so on
  the GPU the weights are held once per step graph used. (Written for onnxruntime-gpu; not run here.)
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..errors import SpecExportError
from ..graphs import PER_ROW_MAX, graph_name, rows_name
from ..models.config import ModelConfig
from ..sampling import SamplingRows
from . import hugepages, ort_capi
from .ort_binding import Binding
from .ort_memory import container, mmap_safetensors, zeroed_host
from .row_probe import exact_rows


class OrtEngine:
    fixed_shapes = True

    def __init__(self, folder: Path, entry: dict, max_batch: int, cache_len: int, ks: tuple[int, ...],
                 threads: int | None = None, device: str = "cpu", target_vocab: int | None = None,
                 prepack: bool | None = None, ops: str = "portable", preload: bool | None = None,
                 shared_with: "OrtEngine | None" = None, batch_invariant: bool = False):
        import onnxruntime as ort
        self.ort = ort
        self.folder = folder
        self.config = ModelConfig.from_manifest(entry["config"])
        self.vocab_size = self.config.vocab_size
        self.target_vocab = target_vocab or self.vocab_size
        self.graphs = entry["graphs"]  # name -> {"file", "inputs", "outputs"}
        self.fused = ops == "fused"
        # multi-token calls at batch > 1 run one row at a time (see _run), unless the build wrote per-row-attention
        # variants of the verify graphs (`<graph>_rows<B>`)
        self.per_row = self.fused and any(g.get("rows") for g in self.graphs.values())
        self.row_by_row = self.fused and not self.per_row
        # batch_invariant: batched target-only steps are exact too (each row's attention over the current token
        # twice, per row: a request's tokens then never depend on its batch; costs 8-24% of a batched
        # target-only step on the 4-bit SmolLM2, B = 4..16); off, they are the batched one-token graph
        if batch_invariant and self.fused and not self.per_row and max_batch > 1:
            raise SpecExportError("batch_invariant=True needs the per-row-attention graphs that specexport build "
                                  "writes for fused engines with --max-batch > 1: rebuild this engine")
        self.batch_invariant = batch_invariant
        self.quant_layers = entry.get("quant_layers") or {}
        self._exact_rows = None
        self._exact_step_widths: dict[tuple[bool, int], tuple[int, ...]] = {}  # (sampling, exact_rows) -> widths
        self.ks = ks
        self.max_batch, self.cache_len = max_batch, cache_len
        self.device = device
        if device == "cuda":
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise SpecExportError("device='cuda' needs onnxruntime-gpu (pip install specexport[gpu]); "
                                      "this onnxruntime has only " + ", ".join(ort.get_available_providers()))
            self.providers = [("CUDAExecutionProvider", {"enable_cuda_graph": "1"})]
        else:
            self.providers = ["CPUExecutionProvider"]
        self.threads = threads
        # pre-packing CPU sessions share one packed copy per weight through the C API's container; where it
        # loads, pre-packing is the default (prepack=None); quantized layers (MatMulNBits: a quantized model, or
        # an fp32 target's certified head) always pre-pack: they run about 150x slower without (the certified
        # head's coarse MatMulNBits took 95 ms of a 134 ms SmolLM2 step unpacked, against 0.8 ms packed)
        shared_packs = device != "cuda" and os.environ.get("SPECEXPORT_ORT_CAPI", "1") != "0" and ort_capi.available()
        self.prepack = bool(entry.get("quant") or entry.get("quant_layers") or entry.get("certified_head")) \
            or (shared_packs if prepack is None else prepack)
        self.capi = shared_packs and self.prepack
        if entry["kv_dtype"] == "bfloat16":
            raise SpecExportError("bf16 engines have no numpy type for ONNX Runtime's buffers here: build with "
                                  "--dtype fp16 (CUDA) or fp32, or load this one with backend='torch'")
        np_dtype = np.dtype(entry["kv_dtype"])
        self._weights = mmap_safetensors(folder / entry["weights"])
        self._weight_values = {}
        # a draft that shares tensors with the target (entry["shared"]: its name -> the target's) reads the target
        # engine's own OrtValues (shared_with), or, loaded alone, a map of the target's file
        shared = entry.get("shared") or {"tensors": {}}
        self._shared_names = shared["tensors"]
        self._maps = [self._weights]  # the mapped files this engine's sessions read (see _drop_weight_pages)
        if self._shared_names:
            theirs = shared_with._weights if shared_with is not None else mmap_safetensors(folder / shared["file"])
            if shared_with is not None and shared_with.capi == self.capi:
                self._shared_value = shared_with._weight_value
            else:  # (the same memory: a value over the target's map is not a copy; no reference to self: a
                # cycle would keep the sessions until a garbage collection)
                make = ort_capi.Value if self.capi else self.ort.OrtValue.ortvalue_from_numpy
                self._shared_value = lambda name: make(theirs[name])
            self._maps.append(theirs)
        cfg = self.config
        shape = (max_batch, cfg.num_kv_heads, cache_len, cfg.head_dim)
        if device == "cuda":  # zeroed: masked positions are multiplied by 0, and 0 x NaN garbage is NaN
            self.kv = [ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np_dtype), "cuda", 0)
                       for _ in range(2 * cfg.num_layers)]
        else:
            self._kv_np = zeroed_host([shape] * (2 * cfg.num_layers), np_dtype)
            self.kv = [ort.OrtValue.ortvalue_from_numpy(a) for a in self._kv_np]
        self.kv_dtype = np_dtype
        self.key_pos = np.arange(cache_len, dtype=np.int64)  # [S]; key_pos[:L] is bound without a copy
        self._sessions: dict[str, object] = {}
        self._key_pos_values: dict[int, object] = {}
        self.busy_s = 0.0  # seconds inside session runs (the benchmark's host-overhead split)
        self.huge_bytes = 0  # packed weights advised to 2 MB pages (hugepages.py)
        for name in self.graphs:  # sessions open at load (slow loading, no first-use pause) or at first use, so
            if (preload is True and self.graphs[name].get("rows", 0) <= max_batch) or \
                    (preload is None and self._greedy_graph(name)):  # that a run holds packed weights only for
                self.session(name)  # the graphs it calls (a variant for more rows than max_batch never runs)
        self._bindings: dict[tuple[str, int, int], Binding] = {}
        self.kv_shared = False  # the caches are another engine's (share_kv)
        self.layers = entry.get("layers")  # a layers: draft: the target layer each of its layers is

    def _their_kv(self, other, values: list) -> list | None:
        """Of `other`'s per-layer caches (keys of every layer, then values), the ones this engine's layers
        stand for: all of them, or a layers: draft's kept layers; None when other has no such layer."""
        n = len(values) // 2
        idx = range(n) if self.layers is None else self.layers
        if not idx or max(idx) >= n:
            return None
        return [values[i] for i in idx] + [values[n + i] for i in idx]

    def mirrors(self, other) -> bool:
        """Can this engine's cache take rows of `other`'s as they are: host buffers, one per layer's keys and
        values, of the same shapes and dtype for each of its layers (a draft of the target's own layers, all of
        them or a layers: draft's kept ones; ModelDrafter.link_kv)?"""
        mine, theirs = getattr(self, "_kv_np", None), getattr(other, "_kv_np", None)
        theirs = None if theirs is None else self._their_kv(other, theirs)
        return mine is not None and theirs is not None and len(mine) == len(theirs) and \
            all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(mine, theirs))

    def share_kv(self, other: "OrtEngine") -> bool:
        """Read and write `other`'s caches instead of this engine's own (dropped): a fused draft of the target's own
        layers whose cache mirrors the target's (ModelDrafter.link_kv). Its first pass then feeds only the current
        token, so it writes nothing below the current position, where the target's committed keys and values
        are; what it writes from there on, the target's verify overwrites before anything reads it. Only before
        the first call (a binding holds the buffers it was made with)."""
        if self.kv_shared:
            theirs = self._their_kv(other, other._kv_np) or []
            return len(theirs) == len(self._kv_np) and all(a is b for a, b in zip(self._kv_np, theirs))
        if not (self.fused and self.mirrors(other)) or self._bindings:
            return False
        self._kv_np, self.kv = self._their_kv(other, other._kv_np), self._their_kv(other, other.kv)
        self.kv_shared = True
        return True

    def copy_kv(self, other: "OrtEngine", row: int, start: int, end: int) -> None:
        """Positions start..end-1 of cache row `row`, copied from `other` (mirrors(other))."""
        for mine, theirs in zip(self._kv_np, self._their_kv(other, other._kv_np)):  # [max_batch, Hkv, S, D] each
            mine[row, :, start:end] = theirs[row, :, start:end]

    def _greedy_graph(self, name: str) -> bool:
        """The graphs greedy decoding can call at this max_batch (preload=None opens these at load; sampling
        graphs open at the first sampled request): a fused engine's 1-token target step only runs at batch > 1,
        and not at all with batch_invariant. Per-row variants open at the first step with their batch size, or all
        at load with preload=True (the servers): each is a session of its own, 0.25-0.3 s to open and 3.7-15 MB
        (B = 2..16) on SmolLM2; the 60 of a k = 2, 4, 8 engine with max_batch 16 take 16 s and 525 MB. Opened
        lazily under load, those pauses fall on the requests in flight."""
        if name.endswith("_sample") or self.graphs[name].get("rows"):
            return False
        return not (self.fused and (self.max_batch == 1 or self.batch_invariant) and name == "verify_k0_greedy")

    def _session_config(self, prepack: bool) -> dict[str, str]:
        config = {} if prepack else {"session.disable_prepacking": "1"}
        # Each session has its own thread pool. A speculative step alternates sessions (draft, verify_k4;
        # verify_k2, verify_k4), and a pool still spinning after its run took the cores the next session needs
        # (a k=4 verify measured 1.6x a target-only step); a pool that never spins pays a thread wake-up per
        # parallel node instead. So pools spin within a run and stop at its end: measured on the Q4_1 engine,
        # one process, alternating, +30% target-only and +27% prompt lookup auto over spinning only in the
        # target-only session.
        config["session.force_spinning_stop"] = "1"
        return config

    def _session_options(self, prepack: bool):
        if self.capi:
            return ort_capi.SessionOptions(self.threads, self._session_config(prepack))
        ort = self.ort
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        for key, value in self._session_config(prepack).items():
            so.add_session_config_entry(key, value)
        if self.threads:
            so.intra_op_num_threads = self.threads
        return so

    def _open(self, rel: str, prepack: bool):
        try:
            return self._new_session(str(self.folder / rel), prepack)
        except Exception as e:  # a graph ORT refuses: say which and why, in one line
            raise SpecExportError(f"onnxruntime cannot load {rel}: {str(e).splitlines()[0]}") from None

    def _new_session(self, path: str, prepack: bool):
        so = self._session_options(prepack)
        # every weight of the model is offered (the graph takes those it names, ORT skips the others): reading
        # the graph's initializer names would need the onnx package, which the runtime does without
        for name in self._weights:
            so.add_initializer(name, self._weight_value(name))
        for name, theirs in self._shared_names.items():
            so.add_initializer(name, self._weight_value(name, theirs))
        if self.capi:
            return ort_capi.Session(path, so, container())
        return self.ort.InferenceSession(path, so, providers=self.providers)

    def session(self, name: str):
        if name not in self.graphs:
            raise SpecExportError(f"this engine has no {name!r} graph (built: {', '.join(sorted(self.graphs))}); "
                                  "rebuild with the k values and modes you need")
        if name not in self._sessions:
            packs = self.prepack and self.device != "cuda"
            before = hugepages.mappings() if packs and hugepages.enabled() else None
            self._sessions[name] = self._open(self.graphs[name]["file"], self.prepack)
            if packs:
                self._drop_weight_pages()
            if before is not None:  # the packed copies this open made, in 2 MB pages (hugepages.py)
                self.huge_bytes += hugepages.collapse_new(before)
        return self._sessions[name]

    def _drop_weight_pages(self) -> None:
        """After a session pre-packed its weights it reads only the packed copy (and the few tensors no kernel
        packs: embedding rows, norms): hand the mapped file's pages back to the page cache (MADV_DONTNEED on a
        read-only file mapping: whatever is read again is faulted back in from the file). A draft that shares the
        target's tensors packs them from the target's map, whose pages it hands back too."""
        import mmap
        for tensors in self._maps:
            for arr in tensors.values():
                base = arr.base
                while base is not None and not isinstance(base, mmap.mmap):
                    base = getattr(base, "_mmap", None) or getattr(base, "base", None)
                if isinstance(base, mmap.mmap):
                    base.madvise(mmap.MADV_DONTNEED)
                    break

    def _weight_value(self, name: str, theirs: str | None = None):
        """theirs: the name of a shared tensor in the target's file."""
        if name not in self._weight_values:
            # a host OrtValue over the map (the CUDA provider copies it to the device for each session)
            self._weight_values[name] = (self._host_value(self._weights[name]) if theirs is None
                                         else self._shared_value(theirs))
        return self._weight_values[name]

    def _host_value(self, array: np.ndarray):
        return ort_capi.Value(array) if self.capi else self.ort.OrtValue.ortvalue_from_numpy(array)

    def key_pos_value(self, L: int):
        """key_pos[:L] as a C API value (one per length, made on first use)."""
        if L not in self._key_pos_values:
            self._key_pos_values[L] = ort_capi.Value(self.key_pos[:L])
        return self._key_pos_values[L]

    def _binding(self, name: str, B: int, row0: int = 0) -> "Binding":
        key = (name, B, row0)
        if key not in self._bindings:
            assert row0 + B <= self.max_batch, f"rows {row0}..{row0 + B - 1} exceed max_batch {self.max_batch}"
            self._bindings[key] = Binding(self, name, B, row0, graph_id=len(self._bindings) + 1)
        return self._bindings[key]

    def _run(self, name: str, B: int, inputs: dict, kv_len: int, row0: int = 0) -> list[np.ndarray]:
        if not (self.fused and B > 1 and (self.graphs[name]["inputs"][0][2][1] > 1 or "_exact" in name)):
            return self._binding(name, B, row0).run(inputs, kv_len)
        # multi-token rows at batch > 1 (and the exact target-only step): chunks of up to PER_ROW_MAX rows, each
        # one call of the graph's per-row-attention variant for its size; a graph without them (prefill, a draft,
        # an engine built before them), row by row
        step = PER_ROW_MAX if rows_name(name, 2) in self.graphs else 1
        sizes = [step] * (B // step) + ([B % step] if B % step else [])
        if step > 1 and sizes[-1] == 1:  # no lone row: its linears would run on one row, which some CPUs round
            sizes[-2:] = [step - 1, 2]  # otherwise (row_probe.py), and batch_invariant promises they never do
        outs, a = [], 0
        for n in sizes:
            g = rows_name(name, n) if n > 1 else name
            part = inputs if n == B else {key: t[a:a + n] for key, t in inputs.items()}
            outs.append(self._binding(g, n, row0 + a).run(part, kv_len))  # (each binding has its own outputs)
            a += n
        return outs[0] if len(outs) == 1 else [np.concatenate(parts) for parts in zip(*outs)]

    def _draft_passes(self, last_two, past_len, kv_len, k, sampling, u, until=None):
        """A fused draft: k one-pass calls. The first pass re-reads the last two committed tokens (at batch > 1 as
        two one-token passes, the first only writing its KV), or, over the target's caches (share_kv), feeds the
        current token alone; each later pass feeds the previous draft token. until(drafts [B, i], margin [B, i] or
        None) -> True ends the chain after i < k passes (the drafts returned are then [B, i]); margin is each
        draft's top logit minus its runner-up (steps.py; sampling: greedy rows' from q, sampled rows' inf; None
        from graphs built before it)."""
        B, mode = len(last_two), sampling is not None

        def one(tokens, pos, i):  # -> draft token [B], its margin [B] or None, q [B, 1, V] or None (copies)
            ins = dict(tokens=tokens, past_len=pos)
            if mode:
                ins.update(_sampling(sampling), u=u[:, i:i + 1])
            out = self._run(graph_name("draft_pass", int(tokens.shape[1]), mode), B, ins, kv_len)
            d = out[0][:, 0].copy()
            if mode:
                q = out[1].copy()
                return d, (_margins(q[:, 0], sampling.greedy) if until is not None else None), q
            return d, (out[1][:, 0].copy() if len(out) > 1 else None), None

        if self.kv_shared:  # positions below the current one are the target's, and stay so
            d, m, q = one(last_two[:, 1:], past_len, 0)
        elif B > 1:
            one(last_two[:, :1], past_len - 1, 0)
            d, m, q = one(last_two[:, 1:], past_len, 0)
        else:
            d, m, q = one(last_two, past_len, 0)
        drafts, margins, qs = [d], [m], [q]
        for i in range(1, k):
            if until is not None and until(np.stack(drafts, 1), None if m is None else np.stack(margins, 1)):
                break
            d, m, q = one(d[:, None], past_len + i, i)
            drafts.append(d)
            margins.append(m)
            qs.append(q)
        return np.stack(drafts, 1), (np.concatenate(qs, 1) if mode else None)  # [B, k], [B, k, V]

    # ---- the Engine protocol -------------------------------------------------------------------

    def prefill(self, tokens, past_len, last_index, kv_len, row0=0):
        return self._run("prefill", len(tokens), dict(tokens=tokens, past_len=past_len, last_index=last_index),
                         kv_len, row0)[0]

    def draft(self, last_two, past_len, kv_len, k, sampling, u, until=None):
        """until: see _draft_passes (a fused draft's chain only; a k-pass graph runs its k passes)."""
        if self.fused:
            return self._draft_passes(last_two, past_len, kv_len, k, sampling, u, until)
        ins = dict(last_two=last_two, past_len=past_len)
        if sampling is not None:
            ins.update(_sampling(sampling), u=u)
        out = self._run(graph_name("draft", k, sampling is not None), len(last_two), ins, kv_len)
        return out[0], (out[1] if sampling is not None else None)

    @property
    def exact_rows(self) -> int:
        """The fewest rows a pass needs for this engine's linears to round a row as among more rows, on this CPU
        (backends/row_probe.py; probed once, at the first target-only step): 1 on most CPUs with pre-packing, 2
        without it (an unpacked one-row fp32 GEMM has its own kernel)."""
        if self._exact_rows is None:
            rows = 1
            if self.device == "cpu":
                rows = exact_rows(self.ort, self.quant_layers, self.threads, self.prepack)
                if not self.fused and self.config.num_heads == self.config.num_kv_heads:
                    # the portable set's attention stacks a kv head's query heads as rows (G x T): without grouped
                    # heads a 1-token pass multiplies one row of probabilities by V, MLAS's one-row GEMV again
                    rows = max(rows, 2)
            self._exact_rows = rows
        return self._exact_rows

    @property
    def free_ks(self) -> tuple[int, ...]:
        """Verify widths that cost what a batch-1 target-only step costs here (built or not: the runtime adds them
        to its ks): where one row rounds differently (exact_rows > 1) that step is the narrowest verify with
        enough rows (`verify_k1`, else the narrowest built k's), so up to that many draft tokens ride in it for
        nothing; else ()."""
        return self._exact_widths(False)[:1] if self.exact_rows > 1 else ()

    def _exact_widths(self, sampling: bool) -> tuple[int, ...]:
        """The verify widths, narrowest first, whose passes have at least exact_rows rows (the batch-1 exact
        target-only step's candidates; made once per mode and exact_rows: this is on the hot path)."""
        key = (sampling, self.exact_rows)
        if key not in self._exact_step_widths:
            self._exact_step_widths[key] = tuple(sorted(j for j in {*self.ks, 1} if j + 1 >= self.exact_rows
                                                        and graph_name("verify", j, sampling) in self.graphs))
        return self._exact_step_widths[key]

    def verify(self, tokens, draft_len, past_len, kv_len, k, sampling, u, q):
        name = graph_name("verify", k, sampling is not None)
        if k == 0 and len(tokens) == 1 and self.exact_rows > 1:  # (module docstring: exactness)
            # one-row linears round differently here: the step is the narrowest verify of at least exact_rows rows
            # over the current token and copies of it that count as no drafts (row 0 is what any verify computes
            # for this position); where none fits the cache, the 1-token step is the only one that runs
            room = self.cache_len - int(past_len[0]) - 1
            kk = next((j for j in self._exact_widths(sampling is not None) if j <= room), 0)
            if kk:
                tokens = np.repeat(tokens[:, :1], kk + 1, 1)  # [1, kk+1]
                if sampling is not None:  # [1, kk+1]: the next token's uniform last
                    u = np.concatenate([np.zeros((1, kk), np.float32), u[:, -1:]], 1)
                return self.verify(tokens, draft_len, past_len, min(kv_len + kk, self.cache_len), kk, sampling,
                                   u, None)
        if k == 0 and self.fused and (len(tokens) == 1 or self.batch_invariant):
            name, kv_len = graph_name("verify_exact", 0, sampling is not None), min(kv_len + 1, self.cache_len)
        ins = dict(tokens=tokens, draft_len=draft_len, past_len=past_len)
        if sampling is not None:
            ins.update(_sampling(sampling), u=u)
            if k > 0:
                ins["q"] = q if q is not None else _one_hot(tokens[:, 1:], self.target_vocab)
        out = self._run(name, len(tokens), ins, kv_len)
        return out[0], out[1], out[2]


def _sampling(s: SamplingRows) -> dict:
    return dict(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, greedy=s.greedy)


def _margins(q: np.ndarray, greedy: np.ndarray) -> np.ndarray:
    """q [B, V] (greedy rows: the softmax at temperature 1) -> [B] log q1 - log q2, the top logit's lead over the
    runner-up, for greedy rows; inf for sampled rows (a sampled draft has no tie to stop at)."""
    out = np.full(len(q), np.inf, np.float32)
    for b in np.flatnonzero(greedy):
        q1, q2 = np.partition(q[b], -2)[-2:][::-1]
        out[b] = np.log(q1) - np.log(q2) if q2 > 0 else np.inf
    return out


def _one_hot(tokens: np.ndarray, V: int) -> np.ndarray:  # [B, k] -> [B, k, V] float32
    out = np.zeros((*tokens.shape, V), np.float32)
    np.put_along_axis(out, tokens[..., None], 1.0, -1)
    return out
