"""`specexport inspect`: what an engine folder holds and the memory the pair needs."""

from __future__ import annotations

import numpy as np

from ..models.layer_spec import format_layers
from ..config import LAYERS_PREFIX, QUANT_PREFIX
from ..manifest import read_manifest


def describe(engine_dir: str) -> dict:
    m = read_manifest(engine_dir)  # hashes checked too: inspect also tells whether the folder is intact
    models = {}
    for role, e in m["models"].items():
        c = e["config"]
        kv_item = np.dtype(e["kv_dtype"]).itemsize
        kv_per_row = 2 * c["num_layers"] * c["num_kv_heads"] * m["cache_len"] * c["head_dim"] * kv_item
        weights = m["files"][e["weights"]]["bytes"]  # its own file: a tensor shared with the target is not in it
        shared = e.get("shared") or {"tensors": {}, "bytes": 0}
        graphs = {name: {"file": g["file"], "bytes": m["files"][g["file"]]["bytes"], "nodes": g.get("nodes"),
                         "op_counts": g.get("op_counts", {}),
                         "inputs": [i for i in g["inputs"] if not i[0].startswith(("key.", "value."))],
                         "outputs": [o for o in g["outputs"] if not o[0].startswith(("key_out.", "value_out."))]}
                  for name, g in e["graphs"].items() if not g.get("rows")}
        variants = [g for g in e["graphs"].values() if g.get("rows")]  # per-row-attention variants
        models[role] = {"source": e["source"], "model_type": c["model_type"], "layers": c["num_layers"],
                        "hidden": c["hidden_size"], "heads": f"{c['num_heads']}/{c['num_kv_heads']}x{c['head_dim']}",
                        "vocab": c["vocab_size"], "weights_bytes": weights, "shared_bytes": shared["bytes"],
                        "shared_tensors": len(shared["tensors"]), "kept_layers": e.get("layers"),
                        "kv_bytes_per_row": kv_per_row,
                        "kv_bytes_max_batch": kv_per_row * m["max_batch"],
                        # a fused draft of the target's own layers (a quantized copy, the target with fewer
                        # layers) runs over the target's caches on ONNX Runtime's CPU provider
                        # (drafters.ModelDrafter.link_kv); elsewhere it keeps its own
                        "kv_target_on_ort_cpu": role == "draft"
                        and e["source"].startswith((QUANT_PREFIX, LAYERS_PREFIX))
                        and m.get("ops", "portable") == "fused",
                        "kv_shape": [m["max_batch"], c["num_kv_heads"], m["cache_len"], c["head_dim"]],
                        "torchscript": e.get("torchscript"), "pt2": e.get("pt2"), "graphs": graphs,
                        "per_row_variants": {"graphs": len(variants), "batches": sorted({g["rows"] for g in variants}),
                                             "bytes": sum(m["files"][g["file"]]["bytes"] for g in variants)},
                        "quantized_linears": _quant_summary(e.get("quant_layers", {}))}
    weights = sum(v["weights_bytes"] for v in models.values())
    kv = sum(v["kv_bytes_max_batch"] for v in models.values())
    kv_ort_cpu = sum(v["kv_bytes_max_batch"] for v in models.values() if not v["kv_target_on_ort_cpu"])
    return {"engine": str(engine_dir), "format_version": m["format_version"],
            "specexport_version": m["specexport_version"], "versions": m.get("versions", {}), "dtype": m["dtype"],
            "ks": m["ks"], "max_batch": m["max_batch"], "max_seq_len": m["max_seq_len"],
            "prefill_chunk": m["prefill_chunk"], "cache_len": m["cache_len"], "drafter": m["drafter"],
            "formats": m.get("formats", []), "ops": m.get("ops", "portable"),
            "weights": m.get("weights", "dequantized"), "activations": m.get("activations"),
            "vocab_size": m["vocab_size"], "eos_token_ids": m["eos_token_ids"],
            "models": models, "files": {rel: f["bytes"] for rel, f in m["files"].items()},
            "memory": {"weights_bytes": weights, "kv_bytes_max_batch": kv, "total_bytes": weights + kv,
                       "kv_bytes_max_batch_ort_cpu": kv_ort_cpu, "total_bytes_ort_cpu": weights + kv_ort_cpu}}


def _quant_summary(layers: dict) -> dict[str, int]:
    """'int4/b32 +min' -> number of linear layers with that layout."""
    out: dict[str, int] = {}
    for rec in layers.values():
        key = f"int{rec['bits']}/b{rec['block_size']}{' +min' if rec.get('mins') else ''}" + \
              ("" if rec["symmetric"] else " zp")
        out[key] = out.get(key, 0) + 1
    return out


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def format_description(d: dict) -> str:
    lines = [f"engine {d['engine']} (format {d['format_version']}, specexport {d['specexport_version']}, "
             f"{', '.join(d['formats'])})",
             f"  dtype {d['dtype']} | k {d['ks']} | max_batch {d['max_batch']} | max_seq_len {d['max_seq_len']} | "
             f"prefill chunk {d['prefill_chunk']} | cache length S {d['cache_len']} | drafter {d['drafter']}",
             f"  vocab {d['vocab_size']} | eos {d['eos_token_ids']} | graph set {d['ops']} | weights {d['weights']}"
             + (f" ({d['activations']} activations in quantized layers)" if d.get("activations") else "")]
    for role, m in d["models"].items():
        lines.append(f"{role}: {m['model_type']} from {m['source']}")
        kept = f" (the target's layers {format_layers(m['kept_layers'])})" if m.get("kept_layers") else ""
        lines.append(f"  {m['layers']} layers{kept}, hidden {m['hidden']}, heads {m['heads']}, vocab {m['vocab']}; "
                     f"weights {_mb(m['weights_bytes'])}; KV {m['kv_shape']} x {2 * m['layers']} = "
                     f"{_mb(m['kv_bytes_max_batch'])} ({_mb(m['kv_bytes_per_row'])} per row)")
        if m["kv_target_on_ort_cpu"]:
            lines.append("  KV on onnxruntime's CPU provider: none of its own (it runs over the target's)")
        if m["shared_tensors"]:
            lines.append(f"  shared with the target: {m['shared_tensors']} tensors, {_mb(m['shared_bytes'])} (held "
                         f"once); separate: {_mb(m['weights_bytes'])}")
        if m["quantized_linears"]:
            lines.append("  quantized linears: " + ", ".join(f"{n} x {k}" for k, n in m["quantized_linears"].items()))
        for name, g in m["graphs"].items():
            ins = ", ".join(f"{n}{list(s)}" for n, _, s in g["inputs"])
            outs = ", ".join(f"{n}{list(s)}" for n, _, s in g["outputs"])
            nodes = f"{g['nodes']:>5} nodes" if g.get("nodes") is not None else ""
            lines.append(f"  {name:<18} {_mb(g['bytes']):>9} {nodes}  ({ins}, kv) -> ({outs}, kv)")
        v = m["per_row_variants"]
        if v["graphs"]:
            lines.append(f"  per-row-attention variants: {v['graphs']} graphs for batches {v['batches'][0]}.."
                         f"{v['batches'][-1]} ({_mb(v['bytes'])}; the verify graphs at batch > 1)")
        if m["torchscript"]:
            lines.append(f"  torchscript {m['torchscript']} ({_mb(d['files'][m['torchscript']])})")
        if m.get("pt2"):
            p = m["pt2"]
            lines.append(f"  pt2 {p['file']} ({_mb(d['files'][p['file']])}, {len(p['graphs'])} AOTInductor graphs, "
                         f"torch {p['torch']}, {p['device']})")
    mem = d["memory"]
    shared = sum(m["shared_bytes"] for m in d["models"].values())
    lines.append(f"memory for the pair: weights {_mb(mem['weights_bytes'])} + KV at max_batch "
                 f"{_mb(mem['kv_bytes_max_batch'])} = {_mb(mem['total_bytes'])}"
                 + (f" ({_mb(shared)} of draft weights read from the target's file)" if shared else ""))
    if mem["kv_bytes_max_batch_ort_cpu"] != mem["kv_bytes_max_batch"]:
        lines.append(f"  on onnxruntime's CPU provider: KV {_mb(mem['kv_bytes_max_batch_ort_cpu'])}, in all "
                     f"{_mb(mem['total_bytes_ort_cpu'])}")
    return "\n".join(lines)
