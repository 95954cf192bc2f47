"""The pt2 backend: the step graphs compiled ahead of time by AOTInductor (export/pt2.py), one package per model,
all graphs of a model reading one copy of its weights (the engine's weights.safetensors, user-managed constants).

On a CUDA device (a package compiled for CUDA), `capture_steps()` replays draft and verify as CUDA graphs like the
torch engine (backends/cuda_graphs.py). specexport build compiles pt2 packages for the CPU only so far, so this
path has only run through the CPU harness's interface, not on a GPU.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import DTYPES
from ..errors import SpecExportError
from ..models import ModelConfig
from ..steps import graph_name
from .torch_engine import TorchScriptEngine


def _compiled_call(runner):
    """A step callable over AOTInductor's flat interface (no pytree round trip per call). Inputs must be
    contiguous: the compiled code assumes the example inputs' strides (the caches' row slices already are)."""
    run = runner.loader.boxed_run

    def call(*xs):
        return run([x if x.is_contiguous() else x.contiguous() for x in xs])
    return call


class Pt2Engine(TorchScriptEngine):
    """TorchScriptEngine's calls over AOTInductor graphs: only how a step callable is found differs."""

    def __init__(self, package: Path, weights: Path, graphs: list[str], config: ModelConfig, max_batch: int,
                 cache_len: int, dtype: torch.dtype, ks: tuple[int, ...], aliases: dict[str, str] | None = None,
                 device: torch.device | str = "cpu", shared: dict[str, torch.Tensor] | None = None):
        """shared: a draft's tensors that are the target's (its name -> the target's tensor, held once)."""
        from safetensors.torch import load_file
        from torch._inductor.package import load_package
        # the one copy every graph reads (kept alive here: user-managed)
        self.weights = load_file(str(weights), device=str(device))
        self.weights.update(shared or {})
        runners = {}
        for name in graphs:
            runner = load_package(str(package), name)
            names = {n: (aliases or {}).get(n, n) for n in runner.get_constant_fqns()}  # tied: stored once
            missing = [n for n, w in names.items() if w not in self.weights]
            if missing:
                raise SpecExportError(f"{package} graph {name} needs {missing[0]}, which {weights.name} lacks: "
                                      "rebuild the engine with specexport build")
            runner.load_constants({n: self.weights[w] for n, w in names.items()}, check_full_update=True,
                                  user_managed=True)
            runners[name] = _compiled_call(runner)
        super().__init__(runners, config, max_batch, cache_len, dtype, ks, device)  # cache_len: the graphs' S (+1)
        self.max_kv_len = cache_len - 1  # the graphs take L <= S - 1 (export/pt2.py: pt2_cache_len)

    def _step(self, kind, k=0, sampling=False):
        return self.module[graph_name(kind, k, sampling)]


def open_pt2(root: Path, entry: dict, m: dict, max_batch: int, ks: tuple[int, ...], device: str = "cpu",
             shared: dict | None = None):
    """The Pt2Engine of one role of an engine folder, after checking the package can load here (shared: a
    sharing draft's tensors that are the target's, engine_dir.shared_tensors)."""
    pt2 = entry.get("pt2")
    if pt2 is None:
        raise SpecExportError(f"{root} has no pt2 packages: rebuild with --format onnx,pt2")
    if pt2["torch"] != torch.__version__:
        raise SpecExportError(f"{root}/{pt2['file']} was compiled by torch {pt2['torch']} and AOTInductor packages "
                              f"load only in the torch that built them; this is torch {torch.__version__}: rebuild "
                              "the engine with specexport build --format ...,pt2 under this torch")
    if device != pt2["device"]:
        raise SpecExportError(f"{root}/{pt2['file']} was compiled for {pt2['device']}, not {device}: rebuild it on "
                              f"a {device} machine, or load with device={pt2['device']!r}")
    return Pt2Engine(root / pt2["file"], root / entry["weights"], pt2["graphs"],
                     ModelConfig.from_manifest(entry["config"]), max_batch, pt2["cache_len"],
                     getattr(torch, DTYPES[m["dtype"]]), ks, pt2.get("aliases", {}), device, shared)
