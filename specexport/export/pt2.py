"""torch.export + AOTInductor (`.pt2`): one package per model, one AOTInductor model per step graph, the weights
read from the engine's own weights.safetensors.

The step modules are the ones the torch and TorchScript backends run (steps.py, `make_step(..., inplace=True,
static=True)`), exported with `torch.export.export` and compiled with AOTInductor into one `steps.pt2` per
model (`target/steps.pt2`, `draft/steps.pt2`). Python loads a graph with
`torch._inductor.package.load_package(path, model_name=<graph name>)`; C++ with
`torch::inductor::AOTIModelPackageLoader(path, <graph name>)`.

What AOTInductor in torch 2.13 allows (checked on CPU with the tiny test models, tests/export/test_pt2.py):
- Several models in one package: yes. Each graph is compiled on its own (`torch._inductor.aot_compile` with
  `aot_inductor.package=True` -> its files), and `torch._inductor.package.package_aoti(path, {name: files})`
  writes them into one archive; `load_package(path, name)` loads one. `aoti_compile_and_package` itself takes one
  ExportedProgram (a dict of them is not accepted), and every model is its own shared library (one C++
  compile per graph: there is no "one .so, several entry points").
- Weights once on disk and in memory: yes. With `aot_inductor.package_constants_in_so=False` the .so files
  carry no weights (the archive holds only code: about 1.7 MB per graph for a tiny model) and
  `package_constants_on_disk_format` left at None writes no weights file into the archive either. At load, every
  graph gets its constants with `load_constants(map, check_full_update=True, user_managed=True)` from one dict of
  tensors read once from the engine's weights.safetensors (the file the ONNX graphs point into): with
  user_managed the loader keeps the caller's pointers (zeroing one of those tensors changes the graphs' output),
  so all graphs of a model share one copy. Constant names are the step module's ("model." + the weights file's
  names; a tied head is stored once, so the manifest maps `model.lm_head.weight`, the name the graphs use, to
  the embedding's); inductor folded no new constants into these graphs, and check_full_update fails loudly if
  a future version does.
- In-place KV-cache mutation: survives, but the write op matters. The eager step writes the caches with
  `scatter_`; export keeps it as an input mutation and after an AOTInductor call the caller's caches hold the
  new keys/values (compared with the eager step; the cache outputs alias the inputs). But inductor lowers a
  mutated-input scatter as copy the whole cache into a buffer, scatter the T new positions, copy the whole
  buffer back: two full [B, Hkv, S, D] copies per cache per call (seen in the generated kernel.cpp). Its
  re-inplacing pass (torch/_inductor/fx_passes/reinplace.py) turns `index_put` on a graph input back into an
  in-place write, but not `scatter`. So the pt2 export traces the steps under `_IndexPutCacheWrites`, a
  TorchFunctionMode that rewrites the cache `scatter_(2, idx, src)` into `cache[rows, :, pos] = src` (the same
  positions; no change to the eager model): the generated kernels then write only the new positions, straight
  into the caller's cache. Row slices `cache[row0:row0 + B]` (contiguous views with a storage offset) are
  updated in place too.
- Dynamic batch: yes, `torch.export.Dim("B", min=1, max=max(2, max_batch))` on every input's dim 0; one compiled
  graph serves every batch size (checked B = 1, 2, 3), so no per-bucket graphs.
- Dynamic key length L (`key_pos` [L], how many cache positions attention reads): yes, but not up to L == S:
  export guards on L != S (slicing [:, :, :L] of an [.., S, D] cache is a no-op view only at L == S). The pt2
  graphs are therefore exported over caches of S + 1 positions (`cache_len + 1`), with L in [1, S]; the extra
  position is never written nor read.
- Inputs must have the compiled strides: AOTInductor reads an input with the strides it was compiled for, so the
  engine passes contiguous tensors (the runtime hands in column slices of its uniforms).
- A package runs only on the torch build that compiled it (the wrapper .so links against libtorch's C++ ABI):
  the manifest records torch's version, and loading with another one is refused (rebuild).

Build time is one C++ compile per graph (export itself is 1-2 s), measured on this project's 2 shared cores
(recorded per graph in the manifest, `pt2.compile_s`): a tiny 2-layer test model 8-23 s per graph depending on
the load; SmolLM2-135M fp32 (30 layers) prefill 54 s, verify_k0 38 s, verify_k4 39 s (94-110 s while other
builds ran). The inductor cache (/tmp/torchinductor_<user>) makes rebuilding identical graphs faster.
Decode speed (tools/pt2_bench.py, batch 1, greedy, 1 thread, alternating backends, SmolLM2 fp32 engine with
prompt lookup k=4): pt2 0.76x ONNX Runtime (fused graph set) target-only and 0.68x with prompt lookup, about
the same as the eager torch backend (1.10x, 1.00x): the time is in the same matmul kernels, and ONNX Runtime's
fused attention and MLAS kernels are faster. On the tiny model, where per-call overhead dominates, pt2 is
about 4x eager torch and 0.85-0.99x ONNX Runtime.
"""

from __future__ import annotations

import inspect
import time
import warnings
from pathlib import Path

import torch

from ..models import StaticKVDecoder
from ..steps import io_names, make_step
from .onnx_graphs import example_inputs

PT2_FILE = "steps.pt2"
INDUCTOR_OPTIONS = {"aot_inductor.package": True, "aot_inductor.package_constants_in_so": False}


class _IndexPutCacheWrites(torch.overrides.TorchFunctionMode):
    """While exporting: a KV-cache write `cache.scatter_(2, idx, src)` (cache [B, Hkv, S, D], idx the positions
    expanded to src's shape [B, Hkv, T, D]) becomes `cache[rows, :, pos] = src`, an index_put_ that inductor
    writes in place into the graph input (a scatter it lowers as a copy of the whole cache and back)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (func is torch.Tensor.scatter_ and not kwargs and len(args) == 4 and args[1] == 2
                and isinstance(args[0], torch.Tensor) and args[0].dim() == 4):
            cache, _, idx, src = args
            pos = idx[:, 0, :, 0]  # [B, T]: every head and channel of a position has the same index
            rows = torch.arange(pos.shape[0], device=pos.device)[:, None].expand_as(pos)  # [B, T]
            cache[rows, :, pos] = src.transpose(1, 2)  # [B, T, Hkv, D]
            return cache
        return func(*args, **(kwargs or {}))


def weight_aliases(model: StaticKVDecoder) -> dict[str, str]:
    """Constant name -> its name in weights.safetensors, where they differ: a tied head is stored once (as the
    embedding), but a compiled graph may name the shared tensor lm_head.weight."""
    from ..steps import PrefillStep
    first: dict[int, str] = {}
    aliases = {}
    for name, t in PrefillStep(model).named_parameters(remove_duplicate=False):
        if id(t) in first:
            aliases[name] = first[id(t)]
        else:
            first[id(t)] = name
    return aliases


def pt2_cache_len(cache_len: int) -> int:
    """The S the pt2 graphs are compiled over: one more than the engine's, so that L can reach cache_len."""
    return cache_len + 1


def _dynamic_shapes(step: torch.nn.Module, names: list[str], max_batch: int, S: int):
    """Dim B on every input's dim 0, Dim L on key_pos, in forward's structure (named args, then *rest)."""
    B = torch.export.Dim("B", min=1, max=max(2, max_batch))
    L = torch.export.Dim("L", min=1, max=S - 1)
    dims = [{0: L} if n == "key_pos" else {0: B} for n in names]
    named = sum(1 for p in inspect.signature(step.forward).parameters.values()
                if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return (*dims[:named], tuple(dims[named:]))


def export_pt2(model: StaticKVDecoder, graphs: list[tuple[str, str, int, bool]], chunk: int, cache_len: int,
               target_vocab: int, max_batch: int, path: Path, on_graph=None) -> dict[str, float]:
    """Export and AOTInductor-compile every graph (name, kind, k, sampling) into one package at `path`.
    Returns graph name -> seconds (export + compile). on_graph(name) is called before each graph."""
    from torch._inductor import aot_compile
    from torch._inductor.package import package_aoti
    S = pt2_cache_len(cache_len)
    files, seconds = {}, {}
    for name, kind, k, sampling in graphs:
        if on_graph is not None:
            on_graph(name)
        t0 = time.perf_counter()
        step = make_step(model, kind, k, sampling, target_vocab, inplace=True, static=True)
        inputs = example_inputs(model, kind, k, sampling, chunk, S, target_vocab)
        names, _ = io_names(kind, k, sampling, model.cfg.num_layers)
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # export/inductor chatter (deprecations inside torch)
            with _IndexPutCacheWrites():
                ep = torch.export.export(step, inputs, dynamic_shapes=_dynamic_shapes(step, names, max_batch, S),
                                         strict=False)
            files[name] = aot_compile(ep.module(check_guards=False), inputs, options=dict(INDUCTOR_OPTIONS))
        seconds[name] = round(time.perf_counter() - t0, 2)
    package_aoti(str(path), files)
    return seconds
