"""How many rows must a pass have for ONNX Runtime to round a row as it rounds it among more, on this CPU?

Speculative output equals target-only output only if a position's logits do not depend on how many rows the pass
that computes them has. MLAS picks kernels by CPU and by row count: on an AVX2 CPU without AVX-512 (an AMD
EPYC; ONNX Runtime 1.22 to 1.32) a 4-bit MatMulNBits with int8 activations runs one row through another kernel
than two or more, and the results differ by about 1e-6 (8-bit codes agree; 2 to 17 rows agree with each other);
after a near tie that flips a greedy token. fp32 linears agree at every row count only where their weights are
pre-packed: MLAS runs an unpacked one-row fp32 GEMM through its own kernel (`KernelM1Routine`), 2e-5 apart on
that CPU, so an engine loaded with prepack=False differs there too. `exact_rows` runs each quantized format an
engine uses (its manifest's `quant_layers`), the fp32 linears as the two graph sets write them (FusedMatMul,
Gemm) and the fp32 MatMul of a block-minimum term, under the engine's pre-packing, over 1, 2, 3 and 9 rows and
compares the first row bit for bit; where one row differs, backends/ort_engine.py runs the batch-1 target-only
step through a verify graph of at least 2 rows (`verify_k1`, which the build adds to an engine with quantized
target layers, else the narrowest built k's).

The probe model is serialized here (protobuf by hand: the runtime does not depend on the onnx package); random
codes, scales and zero points, a few output columns; a few milliseconds per format.
"""

from __future__ import annotations

import math

import numpy as np

_FLOAT, _UINT8 = 1, 2  # TensorProto.DataType


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _len(num: int, payload: bytes) -> bytes:  # a length-delimited field
    return _varint(num << 3 | 2) + _varint(len(payload)) + payload


def _int(num: int, value: int) -> bytes:  # a varint field
    return _varint(num << 3) + _varint(value)


def _str(num: int, s: str) -> bytes:
    return _len(num, s.encode())


def _tensor(name: str, arr: np.ndarray) -> bytes:  # TensorProto: dims 1, data_type 2, name 8, raw_data 9
    dtype = {np.dtype(np.float32): _FLOAT, np.dtype(np.uint8): _UINT8}[arr.dtype]
    return (b"".join(_int(1, d) for d in arr.shape) + _int(2, dtype) + _str(8, name)
            + _len(9, np.ascontiguousarray(arr).tobytes()))


def _value_info(name: str, dims: tuple) -> bytes:  # ValueInfoProto { name, TypeProto { tensor_type { elem, shape } } }
    shape = b"".join(_len(1, _str(2, d) if isinstance(d, str) else _int(1, d)) for d in dims)
    return _str(1, name) + _len(2, _len(1, _int(1, _FLOAT) + _len(2, shape)))


def _node(op: str, inputs: list[str], outputs: list[str], domain: str = "", **ints) -> bytes:
    attrs = b"".join(_len(5, _str(1, k) + _int(3, v) + _int(20, 2)) for k, v in ints.items())  # type INT = 2
    return (b"".join(_str(1, i) for i in inputs) + b"".join(_str(2, o) for o in outputs) + _str(4, op) + attrs
            + (_str(7, domain) if domain else b""))


def probe_model(formats: list[tuple[int, int, int, int, bool]], seed: int = 0) -> bytes:
    """One MatMulNBits per format (bits, block_size, accuracy_level, K, zero points) over input x{K} [M, K], an
    fp32 MatMul xb [M, 32] x [32, 64] (a block-minimum term's shape), and the fp32 linears xf [M, 64] x w^T as
    the fused set (FusedMatMul, transB) and the portable set (Gemm, transB, with a bias) write them."""
    rng = np.random.default_rng(seed)
    nodes, inits, outs = [], [], []
    for i, (bits, bs, acc, K, zp) in enumerate(formats):
        N, nb = 64, math.ceil(K / bs)
        ins = [f"x{K}", f"b{i}", f"s{i}"]
        codes = rng.integers(0, 256, size=(N, nb, bs * bits // 8), dtype=np.uint8)
        inits += [_tensor(f"b{i}", codes), _tensor(f"s{i}", (rng.random(N * nb) * 0.02).astype(np.float32))]
        if zp:
            ins.append(f"z{i}")
            inits.append(_tensor(f"z{i}", rng.integers(0, 256, size=N * math.ceil(nb * bits / 8), dtype=np.uint8)))
        nodes.append(_node("MatMulNBits", ins, [f"y{i}"], "com.microsoft", K=K, N=N, bits=bits, block_size=bs,
                           accuracy_level=acc))
        outs.append((f"y{i}", N))
    inits.append(_tensor("mins", rng.standard_normal((32, 64)).astype(np.float32)))
    nodes.append(_node("MatMul", ["xb", "mins"], ["ym"]))
    outs.append(("ym", 64))
    inits += [_tensor("wf", rng.standard_normal((96, 64)).astype(np.float32)),
              _tensor("bf", rng.standard_normal(96).astype(np.float32))]
    nodes += [_node("FusedMatMul", ["xf", "wf"], ["yf"], "com.microsoft", transB=1),
              _node("Gemm", ["xf", "wf", "bf"], ["yg"], transB=1)]
    outs += [("yf", 96), ("yg", 96)]
    widths = sorted({f[3] for f in formats})
    graph = (b"".join(_len(1, n) for n in nodes) + _str(2, "row_probe") + b"".join(_len(5, t) for t in inits)
             + b"".join(_len(11, _value_info(f"x{K}", ("M", K))) for K in widths)
             + _len(11, _value_info("xb", ("M", 32))) + _len(11, _value_info("xf", ("M", 64)))
             + b"".join(_len(12, _value_info(name, ("M", n))) for name, n in outs))
    opsets = _len(8, _str(1, "") + _int(2, 17)) + _len(8, _str(1, "com.microsoft") + _int(2, 1))
    return _int(1, 8) + _len(7, graph) + opsets


def exact_rows(ort, quant_layers: dict, threads: int | None = None, prepack: bool = True) -> int:
    """The fewest rows a pass needs for every MatMulNBits format in `quant_layers` (a manifest entry's) and the fp32
    MatMuls, pre-packed or not (`prepack`: the engine's sessions'), to give a row the same result, bit for bit, as
    among more rows (3 and 9: a verify at k = 2 and 8): 1 where one row agrees, 2 where only one row differs (the
    AVX2 CPU above: MLAS runs one row through its own kernel and two or more through one tiled kernel), 3 where
    even two differ."""
    formats = sorted({(q["bits"], q["block_size"], q.get("accuracy_level", 0), q["shape"][1], not q["symmetric"])
                      for q in quant_layers.values()})
    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
    if not prepack:
        so.add_session_config_entry("session.disable_prepacking", "1")
    sess = ort.InferenceSession(probe_model(formats), so, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    xs = {i.name: rng.standard_normal((9, i.shape[1])).astype(np.float32) for i in sess.get_inputs()}
    out = {m: sess.run(None, {n: x[:m] for n, x in xs.items()}) for m in (1, 2, 3, 9)}
    for m in (1, 2):
        if all(np.array_equal(a[0], b[0]) and np.array_equal(a[0], c[0])
               for a, b, c in zip(out[m], out[3], out[9])):
            return m
    return 3
