#!/usr/bin/env python
"""The linear kernels of a SmolLM2-135M step, alone: one ONNX Runtime graph per variant holding the 30 layers'
linears at their shapes (qkv 960 x 576, o 576 x 576, gate/up 3072 x 576, down 576 x 1536; random weights, the
lm_head left out), run over M rows, the variants alternating, warm-up excluded. Prints each variant's median time
per pass over all of them and the weight bytes it streams per second, per row count.

What this shows (stop 38, the 2-core AMD EPYC with AVX-512 and VNNI, ONNX Runtime 1.32, 2 threads):
- the int8 draft's kernel (MatMulNBits, 8 bits, block 128, int8 activations) streams ~16 GB/s where fp32
  pre-packed FusedMatMul streams ~23: at one row its linears take 0.36 of the fp32 linears' time, not the 0.25
  their bytes allow, so a `quant:int8` draft pass cannot reach 0.30 of an fp32 step through this kernel. Blocks
  of 32, 64, 256 or 512, symmetric codes, DynamicQuantizeMatMul (per-channel int8: `dq8`) and the other
  accuracy levels (fp32 activations: 25x slower) are all slower at one row;
- 4-bit MatMulNBits with int8 activations costs 15-30% of a one-row pass per extra row (9 rows: 2.3-3.3x one
  row, where fp32 takes 1.4x and `dq8` 1.5x): that is what a verify at k = 2, 4, 8 costs over a target-only step
  on the 4-bit engines, and what bounds prompt lookup there;
- FusedMatMul (transB), MatMul over pre-transposed weights and Gemm run within a few percent of each other;
- `--mlp`: the fused gate/up linear and its Split against two linears (ONNX Runtime GenAI's form): the fused one
  is 1-5% faster; the Split's large share in ONNX Runtime's profiles is the profiler's own.

    python tools/kernel_bench.py                                  # every variant at 1 row
    python tools/kernel_bench.py --variants int4:b32,int8:b128 --rows 1,2,3,5,9
    python tools/kernel_bench.py --mlp --variants fp32,int4:b32
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

D, F, LAYERS = 576, 1536, 30
LINEARS = [("qkv", 960, D), ("o", D, D), ("gate_up", 2 * F, D), ("down", D, F)]  # (name, out, in)
VARIANTS = ("fp32", "fp32:matmul", "fp32:gemm", "int8:b128", "int8:b32", "int4:b32", "dq8")


class _Graph:
    def __init__(self, variant: str, rng: np.random.Generator):
        self.variant, self.rng, self.nodes, self.inits = variant, rng, [], []

    def linear(self, x: str, y: str, n: int, k: int) -> None:
        """y [1, T, n] = x [1, T, k] through the variant's kernel."""
        v, w, rng = self.variant, f"w{len(self.inits)}", self.rng
        if v.startswith(("int8", "int4")):  # MatMulNBits, int8 activations; int8 asymmetric as the drafts are
            bits, block = int(v[3]), int(v.split(":b")[1])
            nb = -(-k // block)
            q = rng.integers(0, 256, size=(n, nb, block * bits // 8), dtype=np.uint8)
            ins = [x, w + "q", w + "s"]
            self.inits += [numpy_helper.from_array(q, w + "q"),
                           numpy_helper.from_array(rng.random(n * nb, dtype=np.float32) * 0.01, w + "s")]
            if bits == 8:
                zp = rng.integers(0, 256, size=n * nb, dtype=np.uint8)
                self.inits.append(numpy_helper.from_array(zp, w + "z"))
                ins.append(w + "z")
            self.nodes.append(helper.make_node("MatMulNBits", ins, [y], domain="com.microsoft", K=k, N=n, bits=bits,
                                               block_size=block, accuracy_level=4))
        elif v == "dq8":  # per-channel int8 weights, dynamically quantized activations
            self.inits += [numpy_helper.from_array(rng.integers(-127, 128, size=(k, n), dtype=np.int8), w),
                           numpy_helper.from_array(rng.random(n, dtype=np.float32) * 0.01, w + "s"),
                           numpy_helper.from_array(np.zeros(n, np.int8), w + "z")]
            self.nodes.append(helper.make_node("DynamicQuantizeMatMul", [x, w, w + "s", w + "z"], [y],
                                               domain="com.microsoft"))
        else:
            weight = rng.standard_normal((n, k), dtype=np.float32) * 0.02
            if v == "fp32:matmul":
                self.inits.append(numpy_helper.from_array(np.ascontiguousarray(weight.T), w))
                self.nodes.append(helper.make_node("MatMul", [x, w], [y]))
            elif v == "fp32:gemm":  # 2-D, as the portable graph set writes it
                shape = w + "shape"
                self.inits += [numpy_helper.from_array(weight, w), numpy_helper.from_array(np.array([-1, k]), shape),
                               numpy_helper.from_array(np.array([1, -1, n]), shape + "y")]
                self.nodes += [helper.make_node("Reshape", [x, shape], [y + "2d"]),
                               helper.make_node("Gemm", [y + "2d", w], [y + "g"], transB=1),
                               helper.make_node("Reshape", [y + "g", shape + "y"], [y])]
            else:
                self.inits.append(numpy_helper.from_array(weight, w))
                self.nodes.append(helper.make_node("FusedMatMul", [x, w], [y], domain="com.microsoft", transB=1))

    def session(self, outputs: list[str], threads: int, wide_input: bool = True) -> ort.InferenceSession:
        ins = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", D])]
        if wide_input:  # [1, T, 1536]: the down projections' input
            ins.append(helper.make_tensor_value_info("xf", TensorProto.FLOAT, [1, "T", F]))
        outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs]
        model = helper.make_model(helper.make_graph(self.nodes, "linears", ins, outs, self.inits),
                                  opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def linears(variant: str, threads: int, seed: int = 0) -> tuple[ort.InferenceSession, int]:
    """The 30 layers' linears, each reading the graph's input of its width -> (session, weight bytes)."""
    g, outs = _Graph(variant, np.random.default_rng(seed)), []
    for layer in range(LAYERS):
        for name, n, k in LINEARS:
            outs.append(f"{name}{layer}")
            g.linear("x" if k == D else "xf", outs[-1], n, k)
    return g.session(outs, threads), sum(n * k for _, n, k in LINEARS) * LAYERS * _bytes(variant)


def mlps(variant: str, threads: int, split: bool, seed: int = 0) -> tuple[ort.InferenceSession, int]:
    """30 MLPs chained through the residual: gate/up as one linear and a Split (ours), or as two linears."""
    g, x = _Graph(variant, np.random.default_rng(seed)), "x"
    g.inits.append(numpy_helper.from_array(np.array([F, F]), "halves"))
    for layer in range(LAYERS):
        gate, up = f"g{layer}", f"u{layer}"
        if split:
            g.linear(x, f"gu{layer}", 2 * F, D)
            g.nodes.append(helper.make_node("Split", [f"gu{layer}", "halves"], [gate, up], axis=-1))
        else:
            g.linear(x, gate, F, D)
            g.linear(x, up, F, D)
        g.nodes += [helper.make_node("QuickGelu", [gate], [f"a{layer}"], domain="com.microsoft", alpha=1.0),
                    helper.make_node("Mul", [f"a{layer}", up], [f"m{layer}"])]
        g.linear(f"m{layer}", f"y{layer}", D, F)
        g.nodes.append(helper.make_node("Add", [x, f"y{layer}"], [f"r{layer}"]))
        x = f"r{layer}"
    if not split:
        g.inits = [i for i in g.inits if i.name != "halves"]
    return g.session([x], threads, wide_input=False), 3 * F * D * LAYERS * _bytes(variant)


def _bytes(variant: str) -> float:
    return {"int8": 1.0, "int4": 0.5, "dq8": 1.0}.get(variant.split(":")[0], 4.0)


def timed(sessions: dict, feeds: dict, reps: int, calls: int = 8) -> dict[str, float]:
    """Median seconds per run of each session, alternating between them (warm-up excluded)."""
    for s in sessions.values():
        for _ in range(5):
            s.run(None, feeds)
    took = {name: [] for name in sessions}
    for r in range(reps):
        for name, s in (sessions.items() if r % 2 == 0 else reversed(sessions.items())):
            t = time.perf_counter()
            for _ in range(calls):
                s.run(None, feeds)
            took[name].append((time.perf_counter() - t) / calls)
    return {name: float(np.median(v)) for name, v in took.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)} "
                    "(intN:bB: MatMulNBits at N bits, blocks of B)")
    ap.add_argument("--rows", default="1", help="comma-separated row counts M (a verify at k runs k + 1)")
    ap.add_argument("--mlp", action="store_true", help="the MLPs, fused gate/up + Split against two linears")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    variants = [v for v in a.variants.split(",") if v]
    if a.mlp:
        sessions, nbytes = {}, {}
        for v in variants:
            for split in (True, False):
                name = f"{v} {'gate/up + Split' if split else 'gate, up'}"
                sessions[name], nbytes[name] = mlps(v, a.threads, split)
    else:
        sessions, nbytes = {}, {}
        for v in variants:
            sessions[v], nbytes[v] = linears(v, a.threads)
    rng = np.random.default_rng(1)
    for m in (int(r) for r in a.rows.split(",")):
        feeds = {"x": rng.standard_normal((1, m, D), dtype=np.float32)}
        if not a.mlp:
            feeds["xf"] = rng.standard_normal((1, m, F), dtype=np.float32)
        took = timed(sessions, feeds, a.reps)
        first = next(iter(took.values()))
        print(f"M = {m}")
        for name, t in took.items():
            print(f"  {name:28s} {1000 * t:8.2f} ms  {nbytes[name] / t / 1e9:6.1f} GB/s of weights  "
                  f"{t / first:5.2f}x the first")


if __name__ == "__main__":
    main()
