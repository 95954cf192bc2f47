#!/usr/bin/env python
"""The linear kernels of a SmolLM2-135M step, alone: one ONNX Runtime graph per variant holding the 30 layers'
linears at their shapes (qkv 960 x 576, o 576 x 576, gate/up 3072 x 576, down 576 x 1536; random weights, the
lm_head left out), run over M rows, the variants alternating, warm-up excluded. Prints each variant's median time
per pass over all of them and the weight bytes it streams per second, per row count.

What this shows (stop 38, the 2-core AMD EPYC with AVX-512 and VNNI, ONNX Runtime 1.32, 2 threads spinning
within a run as the runtime's sessions do; without spinning the int8 and int4 variants ran 1.2-1.5x slower):
- the int8 draft's kernel (MatMulNBits, 8 bits, block 128, int8 activations) takes 0.29-0.33 of the fp32
  pre-packed FusedMatMul's time at one row over four runs (22-28 GB/s of codes, scales and zero points, about
  fp32's; its bytes would allow 0.26). Blocks of 32 (0.34-0.41), 64, 256 or 512 (the same as 128),
  DynamicQuantizeMatMul (per-channel int8: `dq8`, 0.35-0.37) and fp32 activations (other accuracy levels: 25x
  slower) are no faster. The rest of a `quant:int8` draft pass (0.36 of an fp32 step in real decoding) is the
  attention, norms and per-node work that does not shrink;
- 4-bit MatMulNBits with int8 activations takes 1.83x its one-row time for 3 rows and 2.76x for 9 (fp32 1.15x and
  1.33x, `dq8` 1.26x and 1.24x): that is what a verify at k = 2, 4, 8 costs over a target-only step on the 4-bit
  engines, and what bounds prompt lookup there;
- FusedMatMul (transB), MatMul over pre-transposed weights and Gemm run within 3% of each other;
- `q4_1` (stop 45): a GGUF Q4_1 linear as stored, its block minimums' term in several exact forms (README, "GGUF
  weights as stored"): Reshape + ReduceSum + MatMul + Add added 0.24-0.38x to the kernel's time; stop 50 (an Intel
  host with AMX, where it added 0.52-0.54x at one row) built `pool` (block means by one AveragePool, the minimums
  stored times the block size: 0.37-0.39x); `ext` (the kernel's own extra output columns summing each block, then a
  Split) was slower than either (0.64-0.71x);
- `--mlp`: the fused gate/up linear and its Split against two linears (ONNX Runtime GenAI's form): the fused one
  is 1.06-1.08x faster; the Split's large share in ONNX Runtime's profiles is the profiler's own. Stop 41 added the
  MLP as one QMoE node (ONNX Runtime 1.32's CPU kernel, one expert, SwiGLU inside): no faster at one row and
  slower at 3 and 9 (see the README's stop 41 notes).

    python tools/kernel_bench.py                                  # every variant at 1 row
    python tools/kernel_bench.py --variants int4:b32,int8:b128 --rows 1,2,3,5,9
    python tools/kernel_bench.py --mlp --variants fp32,int4:b32
    python tools/kernel_bench.py --mlp --variants int8:b64,int4:b32 --rows 1,3,9
    python tools/kernel_bench.py --variants q4_1:nomin,q4_1,q4_1:nozp,q4_1:indicator,q4_1:einsum --rows 1,2 --reps 40
    python tools/kernel_bench.py --variants q4_1:nomin,q4_1,q4_1:pool,q4_1:ext --rows 1,2 --reps 30
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
Q4_1 = ("q4_1", "q4_1:nomin", "q4_1:nozp", "q4_1:indicator", "q4_1:einsum", "q4_1:ext",  # (not in the default set)
        "q4_1:pool")
FCS = (("fc1", 2 * F, D), ("fc2", D, F))  # an MLP's two QMoE weights: gate/up (interleaved) and down (name, out, in)


def bits_block(variant: str) -> tuple[int, int]:
    """"int8:b128" -> (8, 128)."""
    return int(variant[3]), int(variant.split(":b")[1])


class _Graph:
    def __init__(self, variant: str, rng: np.random.Generator):
        self.variant, self.rng, self.nodes, self.inits = variant, rng, [], []
        self.nbytes = 0  # the weights' bytes as stored: codes, scales, zero points

    def weight(self, array: np.ndarray, name: str) -> None:
        self.inits.append(numpy_helper.from_array(array, name))
        self.nbytes += array.nbytes

    def linear(self, x: str, y: str, n: int, k: int) -> None:
        """y [1, T, n] = x [1, T, k] through the variant's kernel."""
        v, w, rng = self.variant, f"w{len(self.inits)}", self.rng
        if v.startswith("q4_1"):  # a GGUF Q4_1 linear as stored: 4-bit codes, zero points 0, the minimums' term
            self.q4_1(x, y, n, k, v.partition(":")[2] or "terms")
        elif v.startswith(("int8", "int4")):  # MatMulNBits, int8 activations; int8 asymmetric as the drafts are
            bits, block = bits_block(v)
            nb = -(-k // block)
            self.weight(rng.integers(0, 256, size=(n, nb, block * bits // 8), dtype=np.uint8), w + "q")
            self.weight(rng.random(n * nb, dtype=np.float32) * 0.01, w + "s")
            ins = [x, w + "q", w + "s"]
            if bits == 8:
                self.weight(rng.integers(0, 256, size=n * nb, dtype=np.uint8), w + "z")
                ins.append(w + "z")
            self.nodes.append(helper.make_node("MatMulNBits", ins, [y], domain="com.microsoft", K=k, N=n, bits=bits,
                                               block_size=block, accuracy_level=4))
        elif v == "dq8":  # per-channel int8 weights, dynamically quantized activations
            self.weight(rng.integers(-127, 128, size=(k, n), dtype=np.int8), w)
            self.weight(rng.random(n, dtype=np.float32) * 0.01, w + "s")
            self.weight(np.zeros(n, np.int8), w + "z")
            self.nodes.append(helper.make_node("DynamicQuantizeMatMul", [x, w, w + "s", w + "z"], [y],
                                               domain="com.microsoft"))
        else:
            weight = rng.standard_normal((n, k), dtype=np.float32) * 0.02
            if v == "fp32:matmul":
                self.weight(np.ascontiguousarray(weight.T), w)
                self.nodes.append(helper.make_node("MatMul", [x, w], [y]))
            elif v == "fp32:gemm":  # 2-D, as the portable graph set writes it
                self.weight(weight, w)
                shape = w + "shape"
                self.inits += [numpy_helper.from_array(np.array([-1, k], np.int64), shape),
                               numpy_helper.from_array(np.array([1, -1, n], np.int64), shape + "y")]
                self.nodes += [helper.make_node("Reshape", [x, shape], [y + "2d"]),
                               helper.make_node("Gemm", [y + "2d", w], [y + "g"], transB=1),
                               helper.make_node("Reshape", [y + "g", shape + "y"], [y])]
            else:
                self.weight(weight, w)
                self.nodes.append(helper.make_node("FusedMatMul", [x, w], [y], domain="com.microsoft", transB=1))

    def q4_1(self, x: str, y: str, n: int, k: int, form: str) -> None:
        """y = MatMulNBits(x) + blocksum(x) @ mins (models/quant.py), the minimums' term in one of these forms:
        "terms" (before stop 50: Reshape, ReduceSum, MatMul, Add), "pool" (as built since: AveragePool, MatMul,
        Add), "nomin" (none: the kernel alone), "nozp" (the terms, no zero-point input), "indicator" (a MatMul by a
        0/1 block indicator in place of Reshape and ReduceSum), "einsum" (Reshape, then one Einsum), "ext"
        (q4_1_ext)."""
        w, rng, nb = f"w{len(self.inits)}", self.rng, k // 32
        if form == "ext":
            return self.q4_1_ext(x, y, n, k)
        self.weight(rng.integers(0, 256, size=(n, nb, 16), dtype=np.uint8), w + "q")
        self.weight(rng.random(n * nb, dtype=np.float32) * 0.01, w + "s")
        ins = [x, w + "q", w + "s"]
        if form != "nozp":
            self.weight(np.zeros(n * -(-nb // 2), dtype=np.uint8), w + "z")
            ins.append(w + "z")
        out = y if form == "nomin" else y + "nb"
        self.nodes.append(helper.make_node("MatMulNBits", ins, [out], domain="com.microsoft", K=k, N=n, bits=4,
                                           block_size=32, accuracy_level=4))
        if form == "nomin":
            return
        self.weight(rng.standard_normal((nb, n), dtype=np.float32) * 0.01, w + "m")
        shape = numpy_helper.from_array(np.array([1, -1, nb, 32], np.int64), w + "shape")
        if form == "indicator":
            self.inits.append(numpy_helper.from_array(np.repeat(np.eye(nb, dtype=np.float32), 32, axis=0), w + "S"))
            self.nodes.append(helper.make_node("MatMul", [x, w + "S"], [w + "xs"]))
        elif form == "pool":  # x [1, T, k] is (N, C, L) to a 1-D pool: block means, the mins times 32 (exact)
            self.nodes.append(helper.make_node("AveragePool", [x], [w + "xs"], kernel_shape=[32], strides=[32]))
        elif form == "einsum":
            self.inits.append(shape)
            self.nodes += [helper.make_node("Reshape", [x, w + "shape"], [w + "r"]),
                           helper.make_node("Einsum", [w + "r", w + "m"], [w + "mm"], equation="atbk,bn->atn"),
                           helper.make_node("Add", [out, w + "mm"], [y])]
            return
        else:
            self.inits += [shape, numpy_helper.from_array(np.array([-1], np.int64), w + "ax")]
            self.nodes += [helper.make_node("Reshape", [x, w + "shape"], [w + "r"]),
                           helper.make_node("ReduceSum", [w + "r", w + "ax"], [w + "xs"], keepdims=0)]
        self.nodes += [helper.make_node("MatMul", [w + "xs", w + "m"], [w + "mm"]),
                       helper.make_node("Add", [out, w + "mm"], [y])]

    def q4_1_ext(self, x: str, y: str, n: int, k: int) -> None:
        """"ext": the kernel computes the block sums too, as nb more output columns whose codes are 1 on their
        block (scale 1, zero point 0) and 0 elsewhere; a Split, then the minimums' MatMul and Add."""
        w, rng, nb = f"w{len(self.inits)}", self.rng, k // 32
        codes = rng.integers(0, 256, size=(n + nb, nb, 16), dtype=np.uint8)
        codes[n:] = 0
        codes[n + np.arange(nb), np.arange(nb)] = 0x11  # two 4-bit codes of 1 per byte
        scales = rng.random((n + nb) * nb, dtype=np.float32) * 0.01
        scales[n * nb:] = 1.0
        self.weight(codes, w + "q")
        self.weight(scales, w + "s")
        self.weight(np.zeros((n + nb) * -(-nb // 2), dtype=np.uint8), w + "z")
        self.nodes.append(helper.make_node("MatMulNBits", [x, w + "q", w + "s", w + "z"], [y + "ext"],
                                           domain="com.microsoft", K=k, N=n + nb, bits=4, block_size=32,
                                           accuracy_level=4))
        self.weight(rng.standard_normal((nb, n), dtype=np.float32) * 0.01, w + "m")
        self.inits.append(numpy_helper.from_array(np.array([n, nb], np.int64), w + "split"))
        self.nodes += [helper.make_node("Split", [y + "ext", w + "split"], [y + "nb", w + "xs"], axis=-1),
                       helper.make_node("MatMul", [w + "xs", w + "m"], [w + "mm"]),
                       helper.make_node("Add", [y + "nb", w + "mm"], [y])]

    def qmoe(self, x: str, y: str) -> None:
        """y = the MLP of x as one QMoE node (one expert; the variant's bits and block, int8 activations)."""
        bits, block = bits_block(self.variant)
        w, rng = f"w{len(self.inits)}", self.rng
        ins = [x, "router"]
        for name, n, k in FCS:
            self.weight(rng.integers(0, 256, size=(1, n, k * bits // 8), dtype=np.uint8), w + name + "q")
            self.weight(rng.random((1, n, k // block), dtype=np.float32) * 0.01, w + name + "s")
            ins += [w + name + "q", w + name + "s", ""]  # (no bias)
        ins += ["", "", ""]  # no fc3 (gate and up are fc1, interleaved)
        if bits == 8:  # zero points, as the linears' int8 variant (asymmetric, as the drafts are)
            for name, n, k in FCS:
                self.weight(rng.integers(0, 256, size=(1, n, k // block), dtype=np.uint8), w + name + "z")
                ins.append(w + name + "z")
        self.nodes.append(helper.make_node("QMoE", ins, [y], domain="com.microsoft", activation_type="swiglu",
                                           swiglu_fusion=1, activation_alpha=1.0, activation_beta=0.0, k=1,
                                           normalize_routing_weights=0, expert_weight_bits=bits, block_size=block,
                                           accuracy_level=4))

    def session(self, outputs: list[str], threads: int, wide_input: bool = True) -> ort.InferenceSession:
        ins = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", D])]
        if wide_input:  # [1, T, 1536]: the down projections' input
            ins.append(helper.make_tensor_value_info("xf", TensorProto.FLOAT, [1, "T", F]))
        outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs]
        model = helper.make_model(helper.make_graph(self.nodes, "linears", ins, outs, self.inits),
                                  opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)],
                                  ir_version=8)
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.add_session_config_entry("session.force_spinning_stop", "1")  # spin within a run, as the runtime's do
        return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def linears(variant: str, threads: int, seed: int = 0) -> tuple[ort.InferenceSession, int]:
    """The 30 layers' linears, each reading the graph's input of its width -> (session, weight bytes as stored)."""
    g, outs = _Graph(variant, np.random.default_rng(seed)), []
    for layer in range(LAYERS):
        for name, n, k in LINEARS:
            outs.append(f"{name}{layer}")
            g.linear("x" if k == D else "xf", outs[-1], n, k)
    return g.session(outs, threads), g.nbytes


def mlps(variant: str, threads: int, form: str, seed: int = 0) -> tuple[ort.InferenceSession, int]:
    """30 MLPs chained through the residual, in one of three forms: "split" (ours: gate/up as one linear and a
    Split), "two" (gate and up as two linears, ONNX Runtime GenAI's form) or "qmoe" (the whole MLP as one
    com.microsoft QMoE node with a single expert: its CPU kernel runs MatMulNBits' kernels and the SwiGLU inside;
    quantized variants only, its gate/up rows interleaved, blocks that divide both 576 and 1536)."""
    g, x = _Graph(variant, np.random.default_rng(seed)), "x"
    if form == "split":
        g.inits.append(numpy_helper.from_array(np.array([F, F], np.int64), "halves"))
    if form == "qmoe":  # router_probs [T, 1] = 1 (one expert, weight 1), made from x once per pass
        g.inits += [numpy_helper.from_array(np.array([-1, 1], np.int64), "rshape"),
                    numpy_helper.from_array(np.array([-1], np.int64), "raxes"),
                    numpy_helper.from_array(np.zeros((), np.float32), "zero"),
                    numpy_helper.from_array(np.ones((), np.float32), "one")]
        g.nodes += [helper.make_node("ReduceMax", ["x", "raxes"], ["router_max"], keepdims=1),
                    helper.make_node("Reshape", ["router_max", "rshape"], ["router_2d"]),
                    helper.make_node("Mul", ["router_2d", "zero"], ["router_0"]),
                    helper.make_node("Add", ["router_0", "one"], ["router"])]
    for layer in range(LAYERS):
        gate, up = f"g{layer}", f"u{layer}"
        if form == "qmoe":
            g.qmoe(x, f"y{layer}")
        else:
            if form == "split":
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
    return g.session([x], threads, wide_input=False), g.nbytes


def timed(sessions: dict, feeds: dict, reps: int, calls: int = 8) -> dict[str, float]:
    """Median seconds per run of each session, alternating between them (warm-up excluded). Inputs and outputs stay
    bound (IOBinding): no output is copied out, as in the runtime's steps."""
    bound = {}
    for name, s in sessions.items():
        io = s.io_binding()
        for key, value in feeds.items():
            io.bind_cpu_input(key, value)
        outs = [o.name for o in s.get_outputs()]
        for o in outs:
            io.bind_output(o, "cpu")
        s.run_with_iobinding(io)
        values = io.get_outputs()
        io.clear_binding_outputs()
        for o, v in zip(outs, values):  # the first run's buffers, reused by every later run
            io.bind_ortvalue_output(o, v)
        for _ in range(5):
            s.run_with_iobinding(io)
        bound[name] = io
    took = {name: [] for name in sessions}
    for r in range(reps):
        for name, s in (sessions.items() if r % 2 == 0 else reversed(sessions.items())):
            io = bound[name]
            t = time.perf_counter()
            for _ in range(calls):
                s.run_with_iobinding(io)
            took[name].append((time.perf_counter() - t) / calls)
    return {name: float(np.median(v)) for name, v in took.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)} "
                    f"(intN:bB: MatMulNBits at N bits, blocks of B), or {', '.join(Q4_1)}")
    ap.add_argument("--rows", default="1", help="comma-separated row counts M (a verify at k runs k + 1)")
    ap.add_argument("--mlp", action="store_true", help="the MLPs: fused gate/up + Split, two linears, and (quantized "
                    "variants with blocks of 32 or 64) one QMoE node each")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    variants = [v for v in a.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS + Q4_1 and not (v[:4] in ("int4", "int8") and v[4:6] == ":b" and v[6:].isdigit()):
            ap.error(f"unknown variant {v!r}: use {', '.join(VARIANTS + Q4_1)}, or int4:bB / int8:bB with a block "
                     "size B")
    sessions, nbytes = {}, {}
    if a.mlp:
        labels = {"split": "gate/up + Split", "two": "gate, up", "qmoe": "QMoE node"}
        for v in variants:
            qmoe = v.startswith("int") and D % bits_block(v)[1] == 0 and F % bits_block(v)[1] == 0
            for form in ("split", "two") + (("qmoe",) if qmoe else ()):
                name = f"{v} {labels[form]}"
                sessions[name], nbytes[name] = mlps(v, a.threads, form)
    else:
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
