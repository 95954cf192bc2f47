"""The torch backend: the step modules run eagerly over preallocated KV buffers (the reference the others
are tested against), or the same steps loaded from TorchScript (`torch.jit.load`).

The Engine protocol speaks numpy (backends/__init__.py): these engines convert at their boundary
(`torch.from_numpy` in, `.numpy()` out), so torch is imported only when a torch backend is chosen.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..config import DTYPES, QuantSpec
from ..errors import SpecExportError
from ..models import KVCache, ModelConfig, StaticKVDecoder
from ..steps import graph_name, io_names, make_step

CAPTURED = ("draft", "verify")  # the steps capture_steps() replays as graphs (prefill stays eager)


def set_threads(threads: int | None) -> None:
    """torch's intra-op threads (None: leave torch's default)."""
    if threads:
        torch.set_num_threads(threads)


def _t(x: np.ndarray, device) -> torch.Tensor:  # numpy in (a view where it can be)
    return torch.from_numpy(np.ascontiguousarray(x)).to(device)


def _np(t: torch.Tensor) -> np.ndarray:  # numpy out: float outputs as float32 (bf16 has no numpy type)
    if t.is_floating_point() and t.dtype != torch.float32:
        t = t.float()
    return t.cpu().numpy()


class TorchEngine:
    """Eager: any k and any prefill length (the last chunk runs unpadded, verify trims to the proposal).
    After `capture_steps()`, draft and verify are replayed as CUDA graphs (backends/cuda_graphs.py)."""

    fixed_shapes = False
    ks = None
    graphs = None  # StepGraphs once capture_steps() was called

    def __init__(self, model: StaticKVDecoder, max_batch: int, cache_len: int, target_vocab: int | None = None):
        self.model = model
        self.config: ModelConfig = model.cfg
        self.vocab_size = model.cfg.vocab_size
        self.target_vocab = target_vocab or self.vocab_size
        p = next(model.parameters())
        self.device = p.device
        self.cache = KVCache.allocate(self.config, max_batch, cache_len, p.dtype, p.device)  # [max_batch, Hkv, S, D]
        self.key_pos = torch.arange(cache_len, device=p.device)  # [S]; key_pos[:L] is a free view
        self.max_kv_len = cache_len  # the longest key prefix the steps take (captured steps always read it all)
        self.max_batch = max_batch
        self._steps: dict[str, torch.nn.Module] = {}
        self.busy_s = 0.0  # seconds inside step calls (the benchmark's host-overhead split)

    def _kv(self, B: int, row0: int = 0) -> list[torch.Tensor]:
        assert row0 + B <= self.max_batch, f"rows {row0}..{row0 + B - 1} exceed max_batch {self.max_batch}"
        return [t[row0:row0 + B] for t in self.cache.keys + self.cache.values]

    def capture_steps(self, runtime=None, **options) -> "TorchEngine":
        """Replay draft and verify as CUDA graphs from now on: one per (graph, batch bucket), captured on first
        use. runtime: cuda_graphs.CudaRuntime on the engine's device by default (FakeRuntime: the CPU harness);
        options: StepGraphs' (seed, role: 'draft' for a draft model's engine, warmup, check, device_uniforms,
        time_replays)."""
        from .cuda_graphs import CudaRuntime, StepGraphs
        if runtime is None:
            if self.device.type != "cuda":
                raise SpecExportError(f"CUDA graphs need the engine on a CUDA device; it is on {self.device}")
            runtime = CudaRuntime(self.device)
        self.graphs = StepGraphs(runtime, self.max_batch, **options)
        self._steps = {}  # captured steps are built static (no data-dependent branch on the host)
        self._io: dict[str, tuple[list[str], int]] = {}
        return self

    def check_draft(self, draft) -> None:
        """SpeculativeDecoder's entry check of its draft model's engine (None: no draft model): captured steps
        of the two must draw independent device uniforms (cuda_graphs.check_streams)."""
        if self.graphs is not None:
            from .cuda_graphs import check_streams
            check_streams(self.graphs, getattr(draft, "graphs", None))

    def _key_pos(self, kv_len: int) -> torch.Tensor:
        """[L]: the cache prefix attention reads (captured steps: all of it, one fixed shape)."""
        return self.key_pos[:self.max_kv_len if self.graphs is not None else kv_len]

    def _call(self, kind: str, k: int, sampling: bool, *inputs, row0: int = 0) -> list[np.ndarray]:
        """inputs: numpy arrays, or tensors already on the device (key_pos) -> the step's outputs as numpy."""
        step = self._step(kind, k, sampling)
        t0 = time.perf_counter()
        if self.graphs is not None and kind in CAPTURED:
            assert row0 == 0, "captured steps run over cache rows 0.."
            name = graph_name(kind, k, sampling)
            if name not in self._io:  # (input names, outputs before the caches), once per graph
                names, outs = io_names(kind, k, sampling, self.config.num_layers)
                self._io[name] = names, len(outs) - 2 * self.config.num_layers
            names, n_out = self._io[name]
            host = [x if x is None or isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))
                    for x in inputs]
            out = self.graphs.run(name, names[:len(host)], step, host, lambda Bb: self._kv(Bb), n_out)
            self.busy_s += time.perf_counter() - t0
            return out
        inputs = [x if x is None or isinstance(x, torch.Tensor) else _t(x, self.device) for x in inputs]
        out = step(*inputs, *self._kv(len(inputs[0]), row0))
        self.busy_s += time.perf_counter() - t0
        n = len(out) - 2 * self.config.num_layers  # the caches come last
        return [_np(t) for t in out[:n]]

    def _step(self, kind: str, k: int = 0, sampling: bool = False):
        name = graph_name(kind, k, sampling)
        if name not in self._steps:
            self._steps[name] = make_step(self.model, kind, k, sampling, self.target_vocab,
                                          static=self.graphs is not None)
        return self._steps[name]

    @torch.inference_mode()
    def prefill(self, tokens, past_len, last_index, kv_len, row0=0):
        return self._call("prefill", 0, False, tokens, past_len, last_index, self.key_pos[:kv_len], row0=row0)[0]

    @torch.inference_mode()
    def draft(self, last_two, past_len, kv_len, k, sampling, u):
        s = () if sampling is None else (*sampling.as_tuple(), u)
        out = self._call("draft", k, sampling is not None, last_two, past_len, self._key_pos(kv_len), *s)
        return out[0], (out[1] if sampling is not None else None)

    @torch.inference_mode()
    def verify(self, tokens, draft_len, past_len, kv_len, k, sampling, u, q):
        s = ()
        if sampling is not None:
            s = (*sampling.as_tuple(), u)
            if k > 0:
                s += (q if q is not None or not self.fixed_shapes
                      else F.one_hot(_t(tokens[:, 1:], self.device), self.vocab_size).float(),)
        out = self._call("verify", k, sampling is not None, tokens, draft_len, past_len, self._key_pos(kv_len), *s)
        return out[0], out[1], out[2]


class TorchScriptEngine(TorchEngine):
    """The same steps from a TorchScript file: one module per model, one method per step graph."""

    fixed_shapes = True

    def __init__(self, module, config: ModelConfig, max_batch: int, cache_len: int, dtype: torch.dtype,
                 ks: tuple[int, ...], device: torch.device | str = "cpu"):
        self.module = module
        self.config = config
        self.vocab_size = config.vocab_size
        self.device = torch.device(device)
        self.cache = KVCache.allocate(config, max_batch, cache_len, dtype, self.device)
        self.key_pos = torch.arange(cache_len, device=self.device)
        self.max_kv_len = cache_len
        self.max_batch = max_batch
        self.ks = ks
        self.busy_s = 0.0

    def _step(self, kind, k=0, sampling=False):
        return getattr(self.module, graph_name(kind, k, sampling))


_warned = False


def warn_deprecated() -> None:
    """Once per process: TorchScript, written (export/torchscript.py) or opened here, is deprecated upstream."""
    global _warned
    if not _warned:
        _warned = True
        warnings.warn("TorchScript is deprecated upstream; specexport still writes it for libtorch and Triton's "
                      "pytorch_libtorch backend. torch.export / AOTInductor (.pt2) is the path forward.",
                      DeprecationWarning, stacklevel=3)


def open_torchscript(path: Path, config: ModelConfig, max_batch: int, cache_len: int, dtype: str,
                     ks: tuple[int, ...]) -> TorchScriptEngine:
    """A TorchScript engine from an engine folder's module file (dtype: the manifest's, e.g. 'fp32')."""
    warn_deprecated()
    return TorchScriptEngine(torch.jit.load(str(path)), config, max_batch, cache_len, getattr(torch, DTYPES[dtype]), ks)


def load_engine_model(root: Path, entry: dict, dtype: str, cache_len: int,
                      shared: dict[str, torch.Tensor] | None = None) -> StaticKVDecoder:
    """The eager decoder from an engine folder's own weights file (the one the ONNX graphs point into), plus, for a
    draft that shares tensors with the target, `shared` (its name -> the target's tensor, engine_dir.shared_tensors),
    used as they are: held once."""
    from safetensors.torch import load_file
    c = entry["config"]
    legacy = entry.get("quant") and not entry.get("quant_layers")  # quantized from random weights, then loaded
    with torch.device("cpu" if legacy else "meta"):  # a shell: every tensor comes from the files (assign below)
        model = StaticKVDecoder(ModelConfig.from_manifest(c), cache_len).fuse()
        if entry.get("quant_layers"):  # quantized layers (copies, --target-quant, GGUF as stored): shells whose
            from ..models.quant import apply_quant_layers  # codes come from the file
            from ..models.rescore import COARSE, RescoredHead
            if COARSE in entry["quant_layers"]:  # a quantized copy's rescored head (models/rescore.py)
                top = entry.get("rescored_head", {}).get("top")
                model.lm_head = RescoredHead.shell(model.lm_head.out_features, model.lm_head.in_features, top)
            model = apply_quant_layers(model, entry["quant_layers"])
    model._set_rope(torch.float32)  # (not stored: computed, as at build)
    if legacy:  # (engines built before quant_layers was recorded)
        from ..models.quant import quantize_model
        model = quantize_model(model, QuantSpec(**entry["quant"]))
    state = {**load_file(str(root / entry["weights"])), **(shared or {})}
    state = {n.removeprefix("model."): t for n, t in state.items()}
    wanted = model.state_dict()
    tied = model.cfg.tie_word_embeddings and type(model.lm_head) is torch.nn.Linear  # (not a quantized head)
    missing = [n for n in wanted if n not in state and not (n == "lm_head.weight" and tied)]
    if missing:
        raise SpecExportError(f"{entry['weights']} lacks {len(missing)} weights (e.g. {missing[0]}): "
                              "rebuild the engine")
    # assign: the model holds the loaded tensors themselves (a shared tensor stays one tensor)
    model.load_state_dict({n: t for n, t in state.items() if n in wanted}, strict=False, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(getattr(torch, DTYPES[dtype])).eval().requires_grad_(False)
