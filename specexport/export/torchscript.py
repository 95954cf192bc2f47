"""TorchScript export: one module per model, one method per step graph, weights stored once in the file.

libtorch loads it with `torch::jit::load` and calls `module.get_method("verify_k4_greedy")`; Python with
`torch.jit.load(path).verify_k4_greedy(...)`. The methods take and return the tensors listed in steps.py;
the caches are written in place. TorchScript is deprecated upstream: torch.export / AOTInductor (`.pt2`)
is the path forward for new deployments.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from ..backends.torch_engine import warn_deprecated
from ..models import StaticKVDecoder
from ..steps import make_step
from .onnx_graphs import example_inputs

class _Steps(torch.nn.Module):
    def __init__(self, model: StaticKVDecoder):
        super().__init__()
        self.model = model


def export_torchscript(model: StaticKVDecoder, graphs: list[tuple[str, str, int, bool]], chunk: int, cache_len: int,
                       target_vocab: int, path: Path) -> None:
    """graphs: (name, kind, k, sampling) per method."""
    warn_deprecated()
    methods, inputs = {}, {}
    for name, kind, k, sampling in graphs:
        step = make_step(model, kind, k, sampling, target_vocab, inplace=True, static=True)
        methods[name] = (lambda s: (lambda self, *xs: s(*xs)))(step)
        inputs[name] = example_inputs(model, kind, k, sampling, chunk, cache_len, target_vocab)
    container = type("SpecExportSteps", (_Steps,), methods)(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer chatter; the tests compare tokens end to end
        traced = torch.jit.trace_module(container, inputs, check_trace=False)
    torch.jit.save(traced, str(path))
