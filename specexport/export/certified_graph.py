"""The certified head's ONNX nodes (models/certified.py): the traced specexport::CertifiedArgmax node becomes

    MatMulNBits(x) + ReduceMax(|x| per block) @ bound  -> TopK(n + 1)  -> rescore the top n exactly
    If (every row proven): the rescored argmax
    else: TopK(WIDE + 1) of the same upper bounds -> rescore the top WIDE exactly
          If (every row proven): that argmax
          else: FusedMatMul(x, W) -> TopK(n) -> rescore those

rescore: Gather(W, cand) * x -> ReduceSum (the candidates' fp32 logits) -> the lowest id among the largest.
The wide rescoring proves what the top n cannot (high-entropy positions, where more tokens come near the top)
from 64 rows, so the full head almost never runs: its FusedMatMul sits in a subgraph, where ONNX
Runtime does not pre-pack an outer graph's weight, and would read (and keep resident) the whole unpacked head.
An ONNX-level rewrite, as onnx_graphs._pack_qkv is: the legacy exporter has no If with subgraphs from a symbolic.
"""

from __future__ import annotations

import numpy as np

from ..models.certified import MARK

DOMAIN = "specexport"
WIDE = 64  # candidates the second level rescores (SmolLM2: proves every position the top 16 did not)


def expand_certified(proto) -> int:
    """Replace every CertifiedArgmax node of a traced graph by its nodes -> how many were replaced."""
    from onnx import helper, numpy_helper
    graph = proto.graph
    inits = {i.name: i for i in graph.initializer}
    done = 0
    for pos, node in reversed(list(enumerate(graph.node))):
        if node.op_type != MARK or node.domain != DOMAIN:
            continue
        x, w, codes, scales, bound = node.input
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        n, block, bits = attrs["top"], attrs["block"], attrs["bits"]
        nb, V = (int(d) for d in inits[bound].dims)
        p = f"{node.name or 'certified'}_{done}/"
        wide = min(WIDE, V - 1)
        const = {"axes_last": [-1], "axes_row": [-2], "zero": [0], "n": [n], "n1": [n + 1], "wide": [wide],
                 "wide1": [wide + 1], "blocks": [0, 0, nb, block], "vocab": V}
        for name, value in const.items():
            graph.initializer.append(numpy_helper.from_array(np.array(value, np.int64), p + name))
        c = {name: p + name for name in const}
        mk = helper.make_node
        nodes = [
            coarse_node(x, codes, scales, p + "coarse", nb * block, V, block, bits),
            mk("Abs", [x], [p + "abs"]),
            mk("Reshape", [p + "abs", c["blocks"]], [p + "abs_blocks"]),
            mk("ReduceMax", [p + "abs_blocks", c["axes_last"]], [p + "amax"], keepdims=0),  # [B, T, nb]
            mk("MatMul", [p + "amax", bound], [p + "err"]),  # [B, T, V]
            mk("Add", [p + "coarse", p + "err"], [p + "upper"]),
            mk("Unsqueeze", [x, c["axes_row"]], [p + "x_row"]),  # [B, T, 1, D]
        ]
        nodes += _proven(p + "n/", p + "upper", "n", w, p + "x_row", c)
        full = [mk("FusedMatMul", [x, w], [p + "full"], domain="com.microsoft", transB=1),
                mk("TopK", [p + "full", c["n"]], [p + "full_top", p + "full_ids"], axis=-1)]
        full += _rescore(p + "f/", p + "full_ids", w, p + "x_row", c, p + "f/token", p + "f/best")
        wide_nodes = _proven(p + "w/", p + "upper", "wide", w, p + "x_row", c)
        wide_nodes.append(_if(p + "w/", p + "w/all", p + "w/token", p + "f/token", full, p + "wide_token"))
        nodes.append(_if(p + "n/", p + "n/all", p + "n/token", p + "wide_token", wide_nodes, node.output[0]))
        del graph.node[pos]
        for i, new in enumerate(nodes):
            graph.node.insert(pos + i, new)
        done += 1
    if done:
        kept = [o for o in proto.opset_import if o.domain != DOMAIN]
        del proto.opset_import[:]
        proto.opset_import.extend(kept)
    return done


def coarse_node(x: str, codes: str, scales: str, out: str, K: int, N: int, block: int, bits: int):
    """The coarse logits [.., N]: MatMulNBits over the head's codes with int8 activations (accuracy_level 4), the
    kernel whose rounding the bound covers."""
    from onnx import helper
    return helper.make_node("MatMulNBits", [x, codes, scales], [out], domain="com.microsoft", K=K, N=N, bits=bits,
                            block_size=block, accuracy_level=4)


def coarse_model(head):
    """A model of the coarse logits alone, x [M, D] -> [M, V], over a CertifiedHead's codes: what the bound is
    checked against (tests, tools/head_bench.py)."""
    from onnx import TensorProto, helper, numpy_helper
    V, nb, block = (int(d) for d in head.codes.shape)
    graph = helper.make_graph([coarse_node("x", "codes", "scales", "y", nb * block, V, block, 8)], "coarse",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", nb * block])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(head.codes.numpy(), "codes"),
                               numpy_helper.from_array(head.scales.numpy(), "scales")])
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def _proven(p: str, upper: str, width: str, w: str, x_row: str, c: dict) -> list:
    """p + "token" [B, T]: the argmax among the top c[width] upper bounds, rescored; p + "all": a bool scalar, is
    every row proven (its best exact logit above the next upper bound)?"""
    import onnx
    from onnx import helper
    mk = helper.make_node
    nodes = [
        mk("TopK", [upper, c[width + "1"]], [p + "top", p + "ids"], axis=-1),
        mk("Slice", [p + "ids", c["zero"], c[width], c["axes_last"]], [p + "cand"]),
        mk("Slice", [p + "top", c[width], c[width + "1"], c["axes_last"]], [p + "threshold"]),  # [B, T, 1]
    ]
    nodes += _rescore(p, p + "cand", w, x_row, c, p + "token", p + "best")
    return nodes + [
        mk("Greater", [p + "best", p + "threshold"], [p + "proven"]),
        mk("Cast", [p + "proven"], [p + "proven_i"], to=onnx.TensorProto.INT32),
        mk("ReduceMin", [p + "proven_i"], [p + "all_i"], keepdims=0),
        mk("Cast", [p + "all_i"], [p + "all"], to=onnx.TensorProto.BOOL),
    ]


def _if(p: str, cond: str, then_value: str, else_value: str, else_nodes: list, out: str):
    """out = then_value if cond else (else_nodes' else_value): the else branch runs only when needed."""
    import onnx
    from onnx import helper
    info = lambda name: helper.make_tensor_value_info(name, onnx.TensorProto.INT64, None)  # noqa: E731
    then = helper.make_graph([helper.make_node("Identity", [then_value], [p + "then_out"])], p + "then", [],
                             [info(p + "then_out")])
    other = helper.make_graph(else_nodes + [helper.make_node("Identity", [else_value], [p + "else_out"])],
                              p + "else", [], [info(p + "else_out")])
    return helper.make_node("If", [cond], [out], then_branch=then, else_branch=other, name=p + "if")


def _rescore(p: str, cand: str, w: str, x_row: str, c: dict, token: str, best: str) -> list:
    """token [B, T]: the lowest id among the candidates [B, T, n] whose fp32 logit x . W[id] is the largest; best
    [B, T, 1]: that logit."""
    from onnx import helper
    mk = helper.make_node
    return [
        mk("Gather", [w, cand], [p + "rows"], axis=0),  # [B, T, n, D]
        mk("Mul", [p + "rows", x_row], [p + "prod"]),
        mk("ReduceSum", [p + "prod", c["axes_last"]], [p + "exact"], keepdims=0),  # [B, T, n]
        mk("ReduceMax", [p + "exact", c["axes_last"]], [best], keepdims=1),
        mk("Equal", [p + "exact", best], [p + "is_best"]),
        mk("Where", [p + "is_best", cand, c["vocab"]], [p + "best_ids"]),
        mk("ReduceMin", [p + "best_ids", c["axes_last"]], [token], keepdims=0),
    ]
