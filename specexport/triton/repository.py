"""`specexport triton`: write a Triton model repository for an engine folder.

<repo>/<name>/config.pbtxt      python backend, decoupled, max_batch_size 1, generated from the typed data below
<repo>/<name>/1/model.py        specexport/triton/model.py (the runtime in-process, continuous batching)
<repo>/<name>/1/engine/         the engine folder (hard links where the filesystem allows, else copies)
With standalone=True, also <repo>/<name>_<role>_<graph>/ for every ONNX step graph, with an onnxruntime
config, for users who orchestrate the graphs themselves (they then own the KV buffers and the loop).
"""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
from pathlib import Path

from ..errors import SpecExportError
from ..manifest import read_manifest
from .pbtxt import ModelConfig, Tensor

# Names, types and shapes follow TensorRT-LLM's Triton ensemble (all_models/inflight_batcher_llm/ensemble) where they
# mean the same: text_input, max_tokens, temperature, top_k, top_p, seed / random_seed (UINT64), stop_words, end_id,
# stream; beam_width and exclude_input_in_output at the one value we serve (1, true). Ours besides: input_ids, stop
# (= stop_words), chat. Every input is optional (the model checks the prompt).
INPUTS = [
    Tensor("text_input", "TYPE_STRING", (1,), optional=True),
    Tensor("input_ids", "TYPE_INT64", (-1,), optional=True),
    Tensor("max_tokens", "TYPE_INT32", (1,), optional=True),
    Tensor("temperature", "TYPE_FP32", (1,), optional=True),
    Tensor("top_k", "TYPE_INT32", (1,), optional=True),
    Tensor("top_p", "TYPE_FP32", (1,), optional=True),
    Tensor("seed", "TYPE_UINT64", (1,), optional=True),
    Tensor("random_seed", "TYPE_UINT64", (1,), optional=True),  # TensorRT-LLM's older name for seed
    Tensor("stop", "TYPE_STRING", (-1,), optional=True),
    Tensor("stop_words", "TYPE_STRING", (-1,), optional=True),  # TensorRT-LLM's name for stop
    Tensor("end_id", "TYPE_INT32", (1,), optional=True),  # one more stop token id (-1: none)
    Tensor("beam_width", "TYPE_INT32", (1,), optional=True),  # TensorRT-LLM's clients send 1; only 1 is served
    Tensor("exclude_input_in_output", "TYPE_BOOL", (1,), optional=True),  # only true: outputs never echo the prompt
    Tensor("stream", "TYPE_BOOL", (1,), optional=True),
    Tensor("chat", "TYPE_BOOL", (1,), optional=True),
]
# One request is one prompt: with max_batch_size 1 every tensor has a leading batch dimension of 1 ([1, 1] for a
# scalar), the shape TensorRT-LLM's clients and perf_analyzer send; concurrent requests are batched by the model.
MAX_BATCH_SIZE = 1
OUTPUTS = [
    Tensor("text_output", "TYPE_STRING", (1,)),
    Tensor("output_ids", "TYPE_INT64", (-1,)),
    Tensor("finish_reason", "TYPE_STRING", (1,)),  # the final response's stats from here on
    Tensor("prompt_tokens", "TYPE_INT64", (1,)),
    Tensor("completion_tokens", "TYPE_INT64", (1,)),
    Tensor("drafted", "TYPE_INT64", (1,)),
    Tensor("accepted", "TYPE_INT64", (1,)),
    Tensor("acceptance_rate", "TYPE_FP32", (1,)),
    Tensor("mean_tokens_per_step", "TYPE_FP32", (1,)),
]
_TRITON_TYPES = {"int64": "TYPE_INT64", "int32": "TYPE_INT32", "float32": "TYPE_FP32", "float16": "TYPE_FP16",
                 "bool": "TYPE_BOOL", "bfloat16": "TYPE_BF16"}


def default_python_path() -> list[str]:
    """Where this interpreter finds specexport and its dependencies (the model's stub may not)."""
    import specexport
    paths = [str(Path(specexport.__file__).resolve().parents[1])]
    for key in ("purelib", "platlib"):
        p = sysconfig.get_paths()[key]
        if p not in paths:
            paths.append(p)
    return paths


def _link_tree(src: Path, dst: Path) -> None:
    for f in sorted(src.rglob("*")):
        target = dst / f.relative_to(src)
        if f.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(f, target)
        except OSError:
            shutil.copy2(f, target)


def write_repository(engine_dir: str, repo: str, name: str = "specexport", instances: int = 1,
                     max_batch: int | None = None, backend: str | None = None, threads: int | None = None,
                     speculative: bool = True, k: int | str | None = "auto", prepack: bool | None = None,
                     python_path: list[str] | None = None, standalone: bool = False) -> dict:
    m = read_manifest(engine_dir)
    k = "auto" if k is None else k  # a new repository chooses k per step unless told otherwise
    if backend is None:
        backend = "onnxruntime" if m["models"]["target"]["graphs"] else "torch"
    if backend not in ("onnxruntime", "torch", "torchscript"):
        raise SpecExportError(f"backend {backend!r} cannot serve; choose onnxruntime, torch or torchscript")
    if max_batch is not None and not 1 <= max_batch <= m["max_batch"]:
        raise SpecExportError(f"--max-batch {max_batch} must be between 1 and the engine's max_batch {m['max_batch']}")
    if k is not None and k != "auto" and k not in m["ks"]:
        raise SpecExportError(f"k={k} was not built into this engine (built: {m['ks']})")
    if instances < 1:
        raise SpecExportError(f"--instances must be >= 1, got {instances}")
    root = Path(repo) / name
    if root.exists():
        shutil.rmtree(root)
    (root / "1").mkdir(parents=True)
    shutil.copy2(Path(__file__).with_name("model.py"), root / "1" / "model.py")
    _link_tree(Path(engine_dir), root / "1" / "engine")
    params = {"engine": "engine", "backend": backend, "speculative": "true" if speculative else "false",
              "prepack": {True: "true", False: "false", None: "auto"}[prepack],
              "python_path": json.dumps(python_path if python_path is not None else default_python_path())}
    if max_batch:
        params["max_batch"] = str(max_batch)
    if threads:
        params["threads"] = str(threads)
    params["k"] = str(k)
    cfg = ModelConfig(name, "python", INPUTS, OUTPUTS, max_batch_size=MAX_BATCH_SIZE, decoupled=True,
                      instances=instances, parameters=params)
    (root / "config.pbtxt").write_text(cfg.to_pbtxt())
    models = [name]
    if standalone:
        models += write_standalone(Path(engine_dir), Path(repo), name, m)
    return {"repo": str(Path(repo)), "models": models, "backend": backend}


def write_standalone(engine_dir: Path, repo: Path, name: str, m: dict) -> list[str]:
    """One onnxruntime model per step graph (its weights file beside it, as its external data expects)."""
    names = []
    for role, entry in m["models"].items():
        for graph, g in entry["graphs"].items():
            if g.get("rows"):  # (a per-row-attention variant binds its caches row by row: the runtime's own)
                continue
            model = f"{name}_{role}_{graph}"
            d = repo / model / "1"
            if d.parent.exists():
                shutil.rmtree(d.parent)
            d.mkdir(parents=True)
            files = [entry["weights"]] + ([entry["shared"]["file"]] if entry.get("shared") else [])  # (a draft
            for src, dst in [(engine_dir / g["file"], d / "model.onnx")] + [  # sharing the target's tensors)
                    (engine_dir / f, d / Path(f).name) for f in files]:
                try:
                    os.link(src, dst)
                except OSError:
                    shutil.copy2(src, dst)
            tensors = lambda io: [Tensor(n, _TRITON_TYPES[t], tuple(-1 if isinstance(x, str) else x for x in dims))  # noqa: E731
                                  for n, t, dims in io]
            cfg = ModelConfig(model, "onnxruntime", tensors(g["inputs"]), tensors(g["outputs"]))
            (repo / model / "config.pbtxt").write_text(cfg.to_pbtxt())
            names.append(model)
    return names
