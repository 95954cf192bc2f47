#!/usr/bin/env python
"""The fp32 target's lm_head alone, as the fused greedy graphs run it: the full head (FusedMatMul + ArgMax)
against the certified head (models/certified.py: 8-bit codes, the proven bound, the top n rescored, the If), over
the final hidden states of the target's own greedy continuations of the calibration prompts (none is a bench
prompt). Prints how many positions the bound proves, that both heads pick the same tokens, and each head's median
time per call over M rows (the two alternating, warm-up excluded; threads spinning within a run, as the runtime's).

    python tools/head_bench.py                     # SmolLM2-135M-Instruct, rows 1, 2, 9
    python tools/head_bench.py --rows 1,3,12 --top 8
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
from kernel_bench import timed  # noqa: E402
from specexport.export.certified_graph import DOMAIN, coarse_model, expand_certified  # noqa: E402
from specexport.models import load_model  # noqa: E402
from specexport.models.calibration import _greedy, _prompts  # noqa: E402
from specexport.models.certified import CertifiedHead  # noqa: E402


class _Head(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, certified: CertifiedHead | None):
        super().__init__()
        self.weight, self.certified = torch.nn.Parameter(weight, requires_grad=False), certified

    def forward(self, x):  # [1, M, D] -> [1, M]
        if self.certified is not None:
            return self.certified(x, self.weight)
        from specexport.models.ort_ops import linear
        return linear(x, self.weight).argmax(-1)


def session(module: torch.nn.Module, D: int, threads: int):
    import onnx
    import onnxruntime as ort
    with tempfile.TemporaryDirectory() as tmp:
        f = str(Path(tmp) / "head.onnx")
        torch.onnx.export(module, (torch.randn(1, 2, D),), f, dynamo=False, opset_version=18, input_names=["x"],
                          output_names=["token"], dynamic_axes={"x": {1: "M"}, "token": {1: "M"}},
                          custom_opsets={DOMAIN: 1, "com.microsoft": 1})
        proto = onnx.load(f)
    expand_certified(proto)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.add_session_config_entry("session.force_spinning_stop", "1")
    return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,9")
    ap.add_argument("--top", type=int, default=16, help="candidates rescored (n)")
    ap.add_argument("--tokens", type=int, default=48, help="greedy tokens per calibration prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=40)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    target = load_model(None, "fp32", 2048)
    model = target.model
    states, collected = [], []
    hook = model.model.norm.register_forward_hook(lambda _m, _i, o: states.append(o.detach().reshape(-1, o.shape[-1])))
    for ids in _prompts(target):
        states.clear()
        _greedy(model, ids, a.tokens)
        collected.append(torch.cat([states[0][-1:]] + states[1:]))  # each generated position's input to the head
    hook.remove()
    X = torch.cat(collected).numpy()
    W = model.lm_head.weight.detach()
    cert = CertifiedHead(W, a.top)
    heads = {"full head": session(_Head(W, None), W.shape[1], a.threads),
             "certified": session(_Head(W, cert), W.shape[1], a.threads)}
    # how many positions the bound proves (ONNX Runtime's coarse kernel, as in the graph), and equal tokens
    import onnxruntime as ort
    V, D = W.shape
    coarse = ort.InferenceSession(coarse_model(cert).SerializeToString(), providers=["CPUExecutionProvider"])
    c = coarse.run(None, {"x": X})[0].astype(np.float64)
    exact = X.astype(np.float64) @ W.double().numpy().T
    err = np.abs(X).reshape(len(X), D // 32, 32).max(-1).astype(np.float64) @ cert.bound.double().numpy()
    upper = c + err
    order = np.argsort(-upper, -1)[:, :cert.n + 1]
    proven = np.take_along_axis(exact, order[:, :-1], -1).max(-1) > np.take_along_axis(upper, order[:, -1:], -1)[:, 0]
    same = sum(int((heads["full head"].run(None, {"x": X[None, i:i + 1]})[0] ==
                    heads["certified"].run(None, {"x": X[None, i:i + 1]})[0]).all()) for i in range(len(X)))
    print(f"{len(X)} positions: proven {proven.mean():.4f} (n = {cert.n}); largest error / bound "
          f"{(np.abs(c - exact) / err).max():.3f}; same token {same}/{len(X)}")
    for M in (int(r) for r in a.rows.split(",")):
        took = timed(heads, {"x": np.ascontiguousarray(X[None, :M])}, a.reps)
        print(f"rows {M}: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in took.items())
              + f"; certified / full {took['certified'] / took['full head']:.3f}")


if __name__ == "__main__":
    main()
