"""Open an engine folder with a backend: check the manifest, then build the engines the runtime drives.

Torch is imported only for the torch, torchscript and pt2 backends (backends/torch_engine.py, pt2_engine.py); the
onnxruntime path needs numpy, onnxruntime and the tokenizers library.
"""

from __future__ import annotations

from pathlib import Path

from .config import PROMPT_LOOKUP, DecoderConfig
from .drafters import HybridDrafter, ModelDrafter, PromptLookupDrafter
from .errors import SpecExportError
from .manifest import read_manifest
from .models.config import ModelConfig

LOAD_OPTIONS = ("threads", "max_batch", "device", "verify_hashes", "ngram_min", "ngram_max", "min_match", "prepack",
                "drafter", "preload", "cuda_graphs", "batch_invariant", "handover", "min_margin")
DRAFTERS = (PROMPT_LOOKUP, "model", "hybrid")


def shared_tensors(root: Path, entry: dict, theirs: dict | None = None) -> dict | None:
    """A draft's tensors that are the target's (entry["shared"]: its name -> the target's): taken from `theirs`
    (the loaded target's tensors by file name: held once), or from the target's file; None for other models.
    (The onnxruntime engine resolves them itself, as OrtValues.)"""
    shared = entry.get("shared")
    if not shared:
        return None
    if theirs is None:
        from safetensors.torch import load_file
        theirs = load_file(str(root / shared["file"]))
    return {n: theirs[t] for n, t in shared["tensors"].items()}


def check_graphs(m: dict) -> None:
    """Every graph the manifest's k values and modes call for is there, with the inputs and outputs (names and
    batch-free shapes) this version of the runtime binds."""
    from .config import BuildConfig
    from .graphs import graph_list, io_names, tokens_per_pass
    cfg = BuildConfig(ks=tuple(m["ks"]), sampling=m.get("sampling_graphs", True), max_seq_len=m["max_seq_len"],
                      max_batch=m["max_batch"], prefill_chunk=m["prefill_chunk"], dtype=m["dtype"],
                      ops=m.get("ops", "portable"))
    fix = "rebuild it with specexport build"
    for role, entry in m["models"].items():
        n = entry["config"]["num_layers"]
        for name, kind, k, sampling in graph_list(role, cfg):
            if "onnx" not in m.get("formats", ["onnx"]):
                break
            g = entry["graphs"].get(name)
            if g is None:
                raise SpecExportError(f"engine {role} has no {name} graph although it lists k={k}: {fix}")
            want_in, want_out = io_names(kind, k, sampling, n)
            got_in, got_out = [i[0] for i in g["inputs"]], [o[0] for o in g["outputs"]]
            if kind == "draft_pass" and got_out == [o for o in want_out if o != "margin"]:
                want_out = got_out  # built before draft passes reported their margin: runs without the margin stop
            if [x for x in want_in if x in got_in] != got_in or got_out != want_out:  # (unused inputs are pruned)
                raise SpecExportError(f"engine {role} graph {name} has inputs/outputs this specexport does not "
                                      f"expect: {fix}")
            T = tokens_per_pass(kind, k, m["prefill_chunk"])
            if g["inputs"][0][2] != ["B", T]:
                raise SpecExportError(f"engine {role} graph {name} takes {g['inputs'][0][2]} tokens, the manifest "
                                      f"implies ['B', {T}]: {fix}")
        for name, g in entry["graphs"].items():  # per-row-attention variants: of a listed graph, at 2..max_batch
            if g.get("rows") and (g.get("of") not in entry["graphs"] or not 2 <= g["rows"] <= m["max_batch"]):
                raise SpecExportError(f"engine {role} graph {name} is a per-row variant of {g.get('of')!r} at "
                                      f"batch {g['rows']}, which the manifest does not support: {fix}")


def _open(path: str, backend: str, options: dict):
    """Check the options and the manifest -> (root, manifest, DecoderConfig, engine(role) factory)."""
    unknown = set(options) - set(LOAD_OPTIONS)
    if unknown:
        raise SpecExportError(f"unknown load option(s) {', '.join(sorted(unknown))}; known: {', '.join(LOAD_OPTIONS)}")
    root = Path(path)
    m = read_manifest(root, verify_hashes=options.get("verify_hashes", True))
    max_batch = options.get("max_batch") or m["max_batch"]
    if max_batch > m["max_batch"]:
        raise SpecExportError(f"max_batch={max_batch} exceeds the engine's built max_batch={m['max_batch']}: "
                              "pass a smaller one or rebuild with a larger --max-batch")
    ks = tuple(m["ks"])
    check_graphs(m)
    ngram = m.get("ngram", [1, 3])
    config = DecoderConfig(k=max(ks), max_seq_len=m["max_seq_len"], max_batch=max_batch,
                           prefill_chunk=m["prefill_chunk"], backend=backend, dtype=m["dtype"],
                           ngram_min=options.get("ngram_min", ngram[0]), ngram_max=options.get("ngram_max", ngram[1]),
                           min_match=options.get("min_match", min(2, options.get("ngram_max", ngram[1]))),
                           handover=options.get("handover", True),
                           min_margin=options.get("min_margin", DecoderConfig.min_margin),
                           threads=options.get("threads"))
    if config.threads and backend in ("torch", "torchscript", "pt2"):
        from .backends.torch_engine import set_threads
        set_threads(config.threads)
    assert config.cache_len == m["cache_len"], "manifest cache_len disagrees with max_seq_len + max(k) + 1"
    V = m["vocab_size"]
    device = options.get("device", "cpu")

    def _graphs(eng, role):  # torch and pt2 on CUDA: draft and verify replayed as CUDA graphs unless cuda_graphs=False
        if str(device).startswith("cuda") and options.get("cuda_graphs", True):
            eng.capture_steps(role=role)
        return eng

    def engine(role: str, target=None):
        """target: the loaded target engine, whose tensors a draft that shares them reads (held once)."""
        entry = m["models"][role]
        vocab = V if role == "draft" else None
        if backend == "onnxruntime":
            if "onnx" not in m.get("formats", ["onnx"]) or not entry["graphs"]:
                raise SpecExportError(f"{root} has no ONNX graphs: rebuild with --format onnx")
            if device != "cuda" and m["dtype"] != "fp32":
                raise SpecExportError(f"this engine is {m['dtype']}; ONNX Runtime's CPU provider runs fp32 graphs: "
                                      "rebuild with --dtype fp32, or load with device='cuda' (onnxruntime-gpu)")
            from .backends.ort_engine import OrtEngine
            return OrtEngine(root, entry, max_batch, m["cache_len"], ks, config.threads, device, vocab,
                             prepack=options.get("prepack"), ops=m.get("ops", "portable"),
                             preload=options.get("preload"), shared_with=target,
                             batch_invariant=role == "target" and bool(options.get("batch_invariant")))
        if backend == "torchscript":
            if "torchscript" not in entry:
                raise SpecExportError(f"{root} has no TorchScript modules: rebuild with --format onnx,torchscript")
            from .backends.torch_engine import open_torchscript
            return open_torchscript(root / entry["torchscript"], ModelConfig.from_manifest(entry["config"]), max_batch,
                                    m["cache_len"], m["dtype"], ks)
        if backend == "pt2":
            from .backends.pt2_engine import open_pt2
            shared = shared_tensors(root, entry, target.weights if target is not None else None)
            return _graphs(open_pt2(root, entry, m, max_batch, ks, device, shared), role)
        if backend == "torch":
            from .backends.torch_engine import TorchEngine, load_engine_model
            theirs = None
            if target is not None and entry.get("shared"):
                from .steps import weight_tensors
                theirs = weight_tensors(target.model)
            shared = shared_tensors(root, entry, theirs)
            model = load_engine_model(root, entry, m["dtype"], m["cache_len"], shared).to(device)
            eng = TorchEngine(model, max_batch, m["cache_len"], target_vocab=vocab)
            eng.ks = ks  # the same k values as the engine's other backends
            return _graphs(eng, role)
        raise SpecExportError(f"backend {backend!r} is not available; choose onnxruntime, torch, torchscript or pt2")

    return root, m, config, engine


def open_engine_dir(path: str, backend: str, **options):
    """-> (target engine, drafter, DecoderConfig, tokenizer, eos ids, source, can_sample) for SpeculativeDecoder."""
    root, m, config, engine = _open(path, backend, options)
    target = engine("target")
    choice = options.get("drafter")
    if choice not in (None,) + DRAFTERS:
        raise SpecExportError(f"drafter={choice!r}: choose {PROMPT_LOOKUP!r}, 'model' (the engine's own draft) or "
                              "'hybrid' (lookup where it matches, the model elsewhere: the default with a draft model)")
    if choice in ("model", "hybrid") and m["drafter"] == PROMPT_LOOKUP:
        raise SpecExportError(f"drafter={choice!r} but this engine was built without a draft model: rebuild with "
                              "--draft")
    lookup = PromptLookupDrafter(config.ngram_min, config.ngram_max)
    if m["drafter"] == PROMPT_LOOKUP or choice == PROMPT_LOOKUP:
        drafter = lookup
    else:
        drafter = ModelDrafter(engine("draft", target), name=m["models"]["draft"]["source"],
                               min_margin=config.min_margin)
        if choice != "model":
            drafter = HybridDrafter(lookup, drafter, config.min_match, config.handover)
    tokenizer = None
    if m.get("tokenizer"):
        from .tokenizer import Tokenizer
        tokenizer = Tokenizer.from_dir(root / m["tokenizer"])
    return target, drafter, config, tokenizer, m["eos_token_ids"], str(root), bool(m.get("sampling_graphs", True))


def open_draft(path: str, backend: str = "onnxruntime", **options) -> tuple[ModelDrafter, tuple[int, ...]]:
    """Only the draft model of an engine folder, as a drafter (to pair with another engine's target of the same
    model and k values, e.g. to compare drafters over one loaded target) -> (drafter, built ks)."""
    root, m, config, engine = _open(path, backend, options)
    if m["drafter"] == PROMPT_LOOKUP:
        raise SpecExportError(f"{root} was built without a draft model: rebuild with --draft")
    return ModelDrafter(engine("draft"), name=m["models"]["draft"]["source"], min_margin=config.min_margin), \
        tuple(m["ks"])
