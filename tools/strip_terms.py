#!/usr/bin/env python
"""A timing-only copy of an ONNX engine with terms cut out of its graphs: what they cost a step, measured with
tools/engine_ab.py A B --ignore-eos (the copy's values are wrong, so its tokens are too; EOS ignored, every run
decodes the same number of tokens).

- `mins`: the block minimums' term of every GGUF Q4_1 / Q5_1 / Q4_K / Q5_K linear (models/quant.py:
  MatMulNBits(x) + blocksum(x) @ mins, as Reshape, ReduceSum, MatMul, Add, or since stop 50 AveragePool, MatMul,
  Add): the linear is its MatMulNBits alone;
- `zero-points`: the zero-point input of every 4-bit MatMulNBits (the kernel then takes its default, 8).

Measured at stop 45 (the README's "GGUF weights as stored"), the default Q4_1 engine on a 2-core AVX2 host:

    python tools/strip_terms.py engines/smollm2 /tmp/q41-nomins --cut mins
    python tools/engine_ab.py engines/smollm2 /tmp/q41-nomins --ignore-eos --prompts-n 8 --reps 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import onnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specexport.manifest import write_manifest  # noqa: E402


def cut_mins(graph: onnx.GraphProto) -> int:
    """Every Add(MatMulNBits(x), MatMul(.., *.mins)) becomes its MatMulNBits output; dead nodes go."""
    made = {o: n for n in graph.node for o in n.output}
    alias, outputs = {}, {o.name for o in graph.output}
    for n in graph.node:
        if n.op_type == "Add" and len(n.input) == 2 and n.output[0] not in outputs:
            a, b = (made.get(i) for i in n.input)
            if a is not None and b is not None and a.op_type == "MatMulNBits" and b.op_type == "MatMul" \
                    and any(i.endswith(".mins") for i in b.input):
                alias[n.output[0]] = n.input[0]
    for n in graph.node:
        n.input[:] = [alias.get(i, i) for i in n.input]
    need, live = {o.name for o in graph.output}, []
    for n in reversed(graph.node):  # (the nodes are in topological order)
        if any(o in need for o in n.output):
            live.append(n)
            need.update(n.input)
    del graph.node[:]
    graph.node.extend(reversed(live))
    return len(alias)


def cut_zero_points(graph: onnx.GraphProto) -> int:
    cut = 0
    for n in graph.node:
        bits = next((a.i for a in n.attribute if a.name == "bits"), 0)
        if n.op_type == "MatMulNBits" and bits == 4 and len(n.input) >= 4 and n.input[3]:
            n.input[:] = list(n.input[:3]) + ([""] + list(n.input[4:]) if len(n.input) > 4 else [])
            cut += 1
    return cut


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine")
    ap.add_argument("out")
    ap.add_argument("--cut", choices=("mins", "zero-points"), action="append", required=True)
    a = ap.parse_args()
    src, dst = Path(a.engine).resolve(), Path(a.out).resolve()
    if dst == src or src in dst.parents or dst in src.parents:
        sys.exit(f"error: the copy must go outside {src}: give another folder")
    if (dst / "manifest.json").exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.onnx", "*.safetensors"))
    counts = {c: 0 for c in a.cut}
    for f in sorted(src.rglob("*")):
        rel = f.relative_to(src)
        if f.suffix == ".safetensors":
            try:  # (ONNX Runtime reads external data only from the graph's own folder)
                os.link(f, dst / rel)
            except OSError:  # another file system
                shutil.copy2(f, dst / rel)
        elif f.suffix == ".onnx":
            m = onnx.load(str(f), load_external_data=False)
            if "mins" in counts:
                counts["mins"] += cut_mins(m.graph)
            if "zero-points" in counts:
                counts["zero-points"] += cut_zero_points(m.graph)
            onnx.save(m, str(dst / rel))
    write_manifest(dst, json.loads((dst / "manifest.json").read_text()))
    print(f"{dst}: cut {counts} (timing only: its values are wrong)")


if __name__ == "__main__":
    main()
