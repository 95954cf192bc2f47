"""The certified head's ONNX nodes (models/certified.py): the traced specexport::CertifiedArgmax node becomes

    MatMulNBits(x) + ReduceMax(|x| per block) @ bound  -> TopK(n + 1)  -> rescore the top n exactly
    If (every row proven): the rescored argmax
    else:                  FusedMatMul(x, W) -> TopK(n) -> rescore those

rescore: Gather(W, cand) * x -> ReduceSum (the candidates' fp32 logits) -> the lowest id among the largest.
An ONNX-level rewrite, as onnx_graphs._pack_qkv is: the legacy exporter has no If with subgraphs from a symbolic.
"""

from __future__ import annotations

import numpy as np

from ..models.certified import MARK

DOMAIN = "specexport"


def expand_certified(proto) -> int:
    """Replace every CertifiedArgmax node of a traced graph by its nodes -> how many were replaced."""
    import onnx
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
        const = {"axes_last": [-1], "axes_row": [-2], "zero": [0], "n": [n], "n1": [n + 1],
                 "blocks": [0, 0, nb, block], "vocab": V}
        for name, value in const.items():
            graph.initializer.append(numpy_helper.from_array(np.array(value, np.int64), p + name))
        c = {name: p + name for name in const}
        mk = helper.make_node
        nodes = [
            mk("MatMulNBits", [x, codes, scales], [p + "coarse"], domain="com.microsoft", K=nb * block, N=V, bits=bits,
               block_size=block, accuracy_level=4),
            mk("Abs", [x], [p + "abs"]),
            mk("Reshape", [p + "abs", c["blocks"]], [p + "abs_blocks"]),
            mk("ReduceMax", [p + "abs_blocks", c["axes_last"]], [p + "amax"], keepdims=0),  # [B, T, nb]
            mk("MatMul", [p + "amax", bound], [p + "err"]),  # [B, T, V]
            mk("Add", [p + "coarse", p + "err"], [p + "upper"]),
            mk("TopK", [p + "upper", c["n1"]], [p + "upper_top", p + "upper_ids"], axis=-1),
            mk("Slice", [p + "upper_ids", c["zero"], c["n"], c["axes_last"]], [p + "cand"]),
            mk("Slice", [p + "upper_top", c["n"], c["n1"], c["axes_last"]], [p + "threshold"]),  # [B, T, 1]
            mk("Unsqueeze", [x, c["axes_row"]], [p + "x_row"]),  # [B, T, 1, D]
        ]
        nodes += _rescore(p + "c/", p + "cand", w, p + "x_row", c, p + "token", p + "best")
        nodes += [
            mk("Greater", [p + "best", p + "threshold"], [p + "proven"]),
            mk("Cast", [p + "proven"], [p + "proven_i"], to=onnx.TensorProto.INT32),
            mk("ReduceMin", [p + "proven_i"], [p + "all_i"], keepdims=0),
            mk("Cast", [p + "all_i"], [p + "all"], to=onnx.TensorProto.BOOL),
        ]
        out = node.output[0]
        then = helper.make_graph([mk("Identity", [p + "token"], [p + "then_out"])], p + "then", [],
                                 [helper.make_tensor_value_info(p + "then_out", onnx.TensorProto.INT64, None)])
        full = [mk("FusedMatMul", [x, w], [p + "full"], domain="com.microsoft", transB=1),
                mk("TopK", [p + "full", c["n"]], [p + "full_top", p + "full_ids"], axis=-1)]
        full += _rescore(p + "f/", p + "full_ids", w, p + "x_row", c, p + "else_out", p + "full_best")
        other = helper.make_graph(full, p + "else", [],
                                  [helper.make_tensor_value_info(p + "else_out", onnx.TensorProto.INT64, None)])
        nodes.append(mk("If", [p + "all"], [out], then_branch=then, else_branch=other, name=p + "if"))
        del graph.node[pos]
        for i, new in enumerate(nodes):
            graph.node.insert(pos + i, new)
        done += 1
    if done:
        kept = [o for o in proto.opset_import if o.domain != DOMAIN]
        del proto.opset_import[:]
        proto.opset_import.extend(kept)
    return done


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
