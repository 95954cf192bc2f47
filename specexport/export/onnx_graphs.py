"""ONNX export of the step graphs (steps.py), all of one model's graphs sharing one weights file.

Each graph is traced from the same module the torch backend runs (with out-of-place cache writes, so every
layer's cache is a graph input and output that ONNX Runtime updates in place when both are bound to one
buffer). The weights are written once, as `weights.safetensors`; every graph's initializers then point into
that file as ONNX external data (location, offset, length), so the graphs on disk are small and the engine
loads the weights once for all of them.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
import warnings
from pathlib import Path

import torch

from ..graphs import row_cache_name, rows_name
from ..models import StaticKVDecoder
from ..steps import PrefillStep, graph_name, io_names, make_step, tokens_per_pass, weight_tensors
from .certified_graph import DOMAIN, expand_certified

OPSET = 18
WEIGHTS_FILE = "weights.safetensors"
_INLINE_LIMIT = 1 << 16  # initializers larger than this must come from the weights file


def example_inputs(model: StaticKVDecoder, kind: str, k: int, sampling: bool, chunk: int, cache_len: int,
                   target_vocab: int, batch: int = 2) -> tuple[torch.Tensor, ...]:
    """Inputs to trace with (batch 2 and a key prefix L < S, so neither is specialised into the graph)."""
    cfg, B, S = model.cfg, batch, cache_len
    p = next(model.parameters())
    T = tokens_per_pass(kind, k, chunk)
    past = torch.tensor([1, 2] * B)[:B]
    L = min(S, 2 + T + max(k, 1) + 1)
    ids = lambda *shape: torch.randint(0, min(cfg.vocab_size, target_vocab), shape)  # noqa: E731
    kv = [torch.zeros(B, cfg.num_kv_heads, S, cfg.head_dim, dtype=p.dtype) for _ in range(2 * cfg.num_layers)]
    s = (torch.ones(B), torch.zeros(B, dtype=torch.long), torch.ones(B), torch.zeros(B, dtype=torch.bool))
    key_pos = torch.arange(L)
    if kind == "prefill":
        return (ids(B, T), past, torch.full((B,), T - 1), key_pos, *kv)
    if kind in ("draft", "draft_pass"):
        n = 1 if kind == "draft_pass" else k  # draft_pass: one draft token over W = k input tokens
        return (ids(B, T), past, key_pos, *((*s, torch.rand(B, n)) if sampling else ()), *kv)
    extra = ()
    if sampling:
        extra = (*s, torch.rand(B, k + 1)) + ((torch.softmax(torch.randn(B, k, target_vocab), -1),) if k else ())
    return (ids(B, k + 1), torch.full((B,), k), past, key_pos, *extra, *kv)


def dynamic_axes(names: list[str]) -> dict[str, dict[int, str]]:
    return {n: ({0: "L"} if n == "key_pos" else {0: "B"}) for n in names}


def write_weights(model: StaticKVDecoder, path: Path, skip: set[str] = frozenset()) -> dict[str, tuple[str, int, int]]:
    """Save every weight but `skip` (tensors another file holds) -> name -> (file name, byte offset, length)."""
    from safetensors.torch import save_file
    save_file({n: t.contiguous() for n, t in weight_tensors(model).items() if n not in skip}, str(path))
    return {n: (path.name, off, length) for n, (off, length) in safetensors_offsets(path).items()}


def shared_tensors(target: StaticKVDecoder, draft: StaticKVDecoder) -> dict[str, str]:
    """draft weight name -> the target's name for each draft tensor identical to one of the target's (the same
    storage, as in a `layers:` draft, or the same dtype, shape and bytes, as in a quantized copy's embedding):
    the draft's graphs read the target's tensor and the engine holds it once. Empty unless some learned weight is
    shared: a separate checkpoint that has only the computed RoPE tables in common keeps its own files."""
    import hashlib
    theirs = weight_tensors(target)
    by_ptr = {(t.data_ptr(), t.dtype, tuple(t.shape)): n for n, t in theirs.items()}
    digest = lambda t: hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).digest()  # noqa: E731
    by_content: dict | None = None
    out = {}
    for name, t in weight_tensors(draft).items():
        hit = by_ptr.get((t.data_ptr(), t.dtype, tuple(t.shape)))
        if hit is None:
            if by_content is None:  # hashed once, only if some tensor is not shared by storage
                by_content = {(digest(u), u.dtype, tuple(u.shape)): n for n, u in theirs.items()}
            hit = by_content.get((digest(t), t.dtype, tuple(t.shape)))
        if hit is not None:
            out[name] = hit
    learned = {n for n, _ in PrefillStep(draft).named_parameters()}
    return out if learned & set(out) else {}


def safetensors_offsets(path: Path) -> dict[str, tuple[int, int]]:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    base = 8 + n
    return {name: (base + m["data_offsets"][0], m["data_offsets"][1] - m["data_offsets"][0])
            for name, m in header.items() if name != "__metadata__"}


def export_graph(model: StaticKVDecoder, kind: str, k: int, sampling: bool, chunk: int, cache_len: int,
                 target_vocab: int, out_dir: Path, weights: dict[str, tuple[str, int, int]], ops: str = "portable",
                 prefix: str = "", rows: tuple[int, ...] = ()) -> dict[str, dict]:
    """Trace one step graph to out_dir/<prefix><graph>.onnx; `weights` (write_weights) places each weight in a
    file of out_dir.
    ops: "portable" (standard ONNX ops) or "fused" (ONNX Runtime's fused ops, models/ort_ops.py).
    rows: batch sizes that also get the graph's per-row-attention variant (fused only, per_row_attention).
    Returns graph name -> {"file", "inputs", "outputs", ...} for the manifest (names, dtypes, shapes with B / L
    symbolic): the graph, then its variants ({"file", "of": the graph, "rows": B, ...})."""
    import onnx
    name = graph_name(kind, k, sampling)
    module = make_step(model, kind, k, sampling, target_vocab, inplace=False, static=True)
    inputs = example_inputs(model, kind, k, sampling, chunk, cache_len, target_vocab)
    in_names, out_names = io_names(kind, k, sampling, model.cfg.num_layers)
    model.ops = "fused_rows2" if kind == "verify_exact" else ops
    try:
        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tracer chatter about python ints; shapes are checked by the tests
            f = os.path.join(tmp, "g.onnx")
            torch.onnx.export(module, inputs, f, dynamo=False, opset_version=OPSET, input_names=in_names,
                              output_names=out_names, dynamic_axes=dynamic_axes(in_names + out_names),
                              do_constant_folding=True, custom_opsets=_custom_opsets(model, ops, kind, sampling))
            proto = onnx.load(f)
        with torch.no_grad():  # exact output shapes (batch symbolic): custom ops such as MatMulNBits defeat ONNX's
            shapes = [t.shape for t in module(*inputs)]  # shape inference, which would leave dims unnamed
    finally:
        model.ops = "portable"
    _pack_qkv(proto)
    expand_certified(proto)
    _drop_unused_outputs(proto)
    for value_info, shape in zip(proto.graph.output, shapes):
        dims = value_info.type.tensor_type.shape.dim
        for d, n in zip(dims, ["B", *shape[1:]]):
            d.Clear()
            if n == "B":
                d.dim_param = "B"
            else:
                d.dim_value = n
    for init in proto.graph.initializer:
        if init.name in weights:
            file, offset, length = weights[init.name]
            init.ClearField("raw_data")
            init.data_location = onnx.TensorProto.EXTERNAL
            del init.external_data[:]
            for key, value in (("location", file), ("offset", str(offset)), ("length", str(length))):
                entry = init.external_data.add()
                entry.key, entry.value = key, value
        elif len(init.raw_data) > _INLINE_LIMIT:
            raise RuntimeError(f"{name}: initializer {init.name!r} ({len(init.raw_data)} bytes) is not a model "
                               "weight; the export would duplicate it")
    out = {name: {**_save(proto, out_dir / f"{prefix}{name}.onnx"), "inputs": [_io(t) for t in proto.graph.input],
                  "outputs": [_io(t) for t in proto.graph.output]}}
    for B in rows:  # (a variant's inputs and outputs are its graph's, the caches one per row: not listed again)
        variant = _save(per_row_attention(proto, B), out_dir / f"{prefix}{rows_name(name, B)}.onnx")
        out[rows_name(name, B)] = {**variant, "of": name, "rows": B}
    return out


def _save(proto, path: Path) -> dict:
    import onnx
    onnx.save(proto, str(path))
    counts: dict[str, int] = {}
    for node in proto.graph.node:
        if node.op_type != "Constant":  # (folded into initializers when the session loads)
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return {"file": path.name, "nodes": sum(counts.values()),
            "op_counts": dict(sorted(counts.items(), key=lambda kv: -kv[1]))}


def _pack_qkv(proto) -> None:
    """GroupQueryAttention takes the packed [q | k | v] projection as its query input with key and value left
    empty: where its three inputs are the three outputs of one Split, feed it the Split's input instead and drop
    the Split (one node less per layer). An ONNX-level rewrite: the traced graph has the Split."""
    nodes = proto.graph.node
    producer = {o: n for n in nodes for o in n.output}
    consumers: dict[str, int] = {}
    for n in nodes:
        for i in n.input:
            consumers[i] = consumers.get(i, 0) + 1
    for n in [n for n in nodes if n.op_type == "GroupQueryAttention"]:
        split = producer.get(n.input[0])
        if (split is None or split.op_type != "Split" or list(split.output) != list(n.input[:3])
                or any(consumers.get(o, 0) != 1 for o in split.output)):
            continue
        n.input[0], n.input[1], n.input[2] = split.input[0], "", ""
        nodes.remove(split)


def per_row_attention(proto, B: int):
    """A copy of a fused graph for exactly B rows whose GroupQueryAttention runs once per row.

    ONNX Runtime's CPU GroupQueryAttention refuses multi-token rows with a past at batch > 1, so without this a
    fused verify at batch B runs the whole graph B times, each row reading every weight again. Here
    the linears, norms and acceptance run over all B rows at once (their kernels give a row the same bits
    whatever the row count) and only attention is split: each layer's q/k/v [B, T, .] (packed or not) is split
    into B rows, each row's attention writes its own cache row in place, and the outputs are concatenated. A
    row's attention is then the very call a batch-1 pass makes, so the tokens are the row-by-row ones.

    The cache inputs and outputs `key.{l}` [B, Hkv, S, D] become one per row: `key.{l}.{r}` [1, Hkv, S, D]
    (rows in order, for each cache in the graph's order), bound to the cache rows themselves."""
    import onnx
    from onnx import helper
    g = onnx.ModelProto()
    g.CopyFrom(proto)
    graph = g.graph
    caches = [i.name for i in graph.input if i.name.startswith(("key.", "value."))]
    nodes, split_done = [], {}

    def split(name: str) -> list[str]:  # rows of `name` along axis 0, split once per tensor
        if name not in split_done:
            split_done[name] = [f"{name}/row{r}" for r in range(B)]
            nodes.append(helper.make_node("Split", [name], split_done[name], axis=0, num_outputs=B,
                                          name=f"{name}/split_rows"))
        return split_done[name]

    for n in graph.node:
        if n.op_type != "GroupQueryAttention":
            nodes.append(n)
            continue
        key, value, seqlens = n.input[3], n.input[4], n.input[5]
        assert key in caches and value in caches, f"{n.name}: per-row attention needs the caches as graph inputs"
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        qkv_rows = [split(x) if x else [""] * B for x in n.input[:3]]  # packed q/k/v, or q, k, v
        len_rows = split(seqlens)
        out, key_out, value_out = n.output
        for r in range(B):
            nodes.append(helper.make_node(
                "GroupQueryAttention", [*(x[r] for x in qkv_rows), row_cache_name(key, r), row_cache_name(value, r),
                                        len_rows[r], *n.input[6:]],
                [f"{out}/row{r}", row_cache_name(key_out, r), row_cache_name(value_out, r)], domain="com.microsoft",
                name=f"{n.name}/row{r}", **attrs))
        nodes.append(helper.make_node("Concat", [f"{out}/row{r}" for r in range(B)], [out], axis=0,
                                      name=f"{n.name}/rows"))
    del graph.node[:]
    graph.node.extend(nodes)
    cache_prefixes = ("key.", "value.", "key_out.", "value_out.")
    for field in (graph.input, graph.output):
        kept = [v for v in field if not v.name.startswith(cache_prefixes)]
        per_row = []
        for v in field:
            if v.name.startswith(cache_prefixes):
                for r in range(B):
                    w = onnx.ValueInfoProto()
                    w.CopyFrom(v)
                    w.name = row_cache_name(v.name, r)
                    w.type.tensor_type.shape.dim[0].Clear()
                    w.type.tensor_type.shape.dim[0].dim_value = 1
                    per_row.append(w)
        del field[:]
        field.extend(kept + per_row)
    for v in list(graph.input) + list(graph.output):  # every other batch dimension is B now
        for d in v.type.tensor_type.shape.dim[:1]:
            if d.dim_param == "B":
                d.Clear()
                d.dim_value = B
    return g


def _drop_unused_outputs(proto) -> None:
    """Name no optional output that nothing reads: SkipSimplifiedLayerNormalization's mean and inverse std
    (outputs 1 and 2, for training) are then not written. The traced node names all four outputs. Measured on
    the int4 SmolLM2 step: +2.5% target-only decode. Reads inside subgraphs (the certified head's If) count."""
    read = _reads(proto.graph) | {o.name for o in proto.graph.output}
    for n in proto.graph.node:
        if n.op_type == "SkipSimplifiedLayerNormalization":
            for j in (1, 2):
                if len(n.output) > j and n.output[j] not in read:
                    n.output[j] = ""


def _reads(graph) -> set[str]:
    """Every value a graph's nodes read, its subgraphs' (If branches) included."""
    from onnx import AttributeProto
    out = set()
    for n in graph.node:
        out.update(n.input)
        for a in n.attribute:
            if a.type == AttributeProto.GRAPH:
                out |= _reads(a.g)
    return out


def _custom_opsets(model: torch.nn.Module, ops: str, kind: str, sampling: bool) -> dict | None:
    """com.microsoft: the fused set's ops, and MatMulNBits for quantized models; specexport: the certified head's
    node in fused greedy verify graphs, expanded after the trace (certified_graph.py)."""
    from ..models.quant import QuantLinear
    fused = ops == "fused" or any(isinstance(m, QuantLinear) for m in model.modules())
    certified = ops == "fused" and model.head_search is not None and kind.startswith("verify") and not sampling
    return {"com.microsoft": 1, **({DOMAIN: 1} if certified else {})} if fused else None


def _io(value_info) -> list:
    import onnx
    t = value_info.type.tensor_type
    dims = [d.dim_param or d.dim_value for d in t.shape.dim]
    return [value_info.name, onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name, dims]
