"""`specexport build`: load a target/draft pair, export their step graphs, save the engine folder, check it.

Folder layout:
  manifest.json            see manifest.py
  tokenizer/               the target's tokenizer (save_pretrained)
  target/weights.safetensors, target/<graph>.onnx, target/steps.torchscript.pt, target/steps.pt2 (pt2.py)
  draft/...                the same for a draft model (none for prompt lookup)
  target/draft.*           ... or here, for a draft that shares tensors with the target (a `layers:` draft, a
                           quantized copy's embedding): its graphs point into target/weights.safetensors for those,
                           into target/draft.weights.safetensors for its own (ONNX Runtime reads external data only
                           from the graph's folder), and the engine holds each shared tensor once
Stages: load (and check the pair), export, save, check (the engine must give the eager torch tokens).
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..config import PROMPT_LOOKUP, BuildConfig, QuantSpec, is_quant_spec
from ..draft_models import load_draft
from ..errors import SpecExportError
from ..graphs import PER_ROW_MAX
from ..models import LoadedModel, load_model, read_config, resolve_path
from ..models.certified import BITS, BLOCK, SAFETY, certified_head
from ..models.quant import quant_layers, quantize_model
from ..models.layer_spec import LayerSpec, is_layers_spec
from ..steps import graph_list
from ..version import __version__
from ..manifest import MANIFEST, graph_code, write_manifest
from .onnx_graphs import OPSET, WEIGHTS_FILE, export_graph, shared_tensors, write_weights
from .torchscript import export_torchscript

TORCHSCRIPT_FILE = "steps.torchscript.pt"
CHECK_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]  # token ids: every vocabulary has them


class _Stages:
    """Prints each stage with its time (stderr), and keeps the timings for --json."""

    def __init__(self, show: bool):
        self.show, self.times, self._t = show, {}, None

    def start(self, name: str, what: str) -> None:
        self._name, self._t = name, time.perf_counter()
        if self.show:
            print(f"[{name}] {what} ...", file=sys.stderr, flush=True)

    def done(self, detail: str = "") -> None:
        dt = time.perf_counter() - self._t
        self.times[self._name] = round(dt, 2)
        if self.show:
            print(f"[{self._name}] done in {dt:.1f}s{'  ' + detail if detail else ''}", file=sys.stderr, flush=True)


def build(cfg: BuildConfig, progress: bool = True) -> dict:
    """Build the engine folder cfg.out; returns a summary (stages with seconds, files, sizes)."""
    from tqdm import tqdm
    dec_cfg = cfg.decoder()
    out = Path(cfg.out)
    if out.exists() and any(out.iterdir()) and not (out / MANIFEST).exists():
        raise SpecExportError(f"--out {str(out)!r} exists and is not an engine folder: choose an empty or new path")
    quant = QuantSpec.parse(cfg.draft) if is_quant_spec(cfg.draft) else None  # bad input fails before any stage
    torch_formats = [f for f in ("torchscript", "pt2") if f in cfg.formats]  # no low-bit kernel in either
    if quant is not None and torch_formats:
        raise SpecExportError(f"draft {cfg.draft!r} exports to ONNX (MatMulNBits) only; {torch_formats[0]} has no "
                              f"low-bit kernel: drop {','.join(torch_formats)} from --format, or use a draft model")
    if cfg.target_quant and torch_formats:
        raise SpecExportError(f"--target-quant exports to ONNX (MatMulNBits) only; {torch_formats[0]} has no low-bit "
                              f"kernel: drop {','.join(torch_formats)} from --format")
    layer_spec = LayerSpec.parse(cfg.draft) if is_layers_spec(cfg.draft) else None
    if layer_spec and layer_spec.quant and torch_formats:
        raise SpecExportError(f"draft {cfg.draft!r} is quantized, which exports to ONNX (MatMulNBits) only: drop "
                              f"{','.join(torch_formats)} from --format, or drop the :int8/:int4 suffix")
    for spec, role in ((cfg.target, "target"), (cfg.draft, "draft")):
        if spec != PROMPT_LOOKUP and not is_quant_spec(spec) and not is_layers_spec(spec):
            read_config(resolve_path(spec, role))
    if layer_spec and layer_spec.keep is not None:  # a list that doesn't fit fails now
        layer_spec.check(read_config(resolve_path(cfg.target)).num_layers, cfg.draft)
    st = _Stages(progress)

    st.start("load", "loading the models and checking the pair")
    stored = dict(gguf_stored=cfg.dtype is None, accuracy_level=cfg.accuracy_level)  # GGUF codes as stored
    target = load_model(cfg.target, dec_cfg.dtype, dec_cfg.cache_len, role="target", **stored)
    models: dict[str, LoadedModel] = {"target": target}
    # a quantized-copy draft starts from the float weights (quantize the target after it); a float layers: draft
    # is the target's own modules, quantized or not (quantize before it)
    shares_modules = layer_spec is not None and not layer_spec.quant
    if cfg.target_quant and shares_modules:
        quantize_model(target.model, cfg.target_quant_spec())
    if cfg.draft != PROMPT_LOOKUP:  # an unfit draft fails here, before any export
        models["draft"] = load_draft(cfg.draft, target, dec_cfg, **stored, ks=cfg.ks)
    if cfg.target_quant and not shares_modules:
        quantize_model(target.model, cfg.target_quant_spec())
    if cfg.target_head == "certified" and cfg.ops == "fused" and "onnx" in cfg.formats:  # (after the draft's copy:
        target.model.head_search = certified_head(target.model.lm_head)  # the target's fused greedy graphs only)
        if target.model.head_search is not None:
            h = target.model.head_search
            target.record["certified_head"] = {"bits": BITS, "block": BLOCK, "top": h.n, "safety": SAFETY}
    st.done(", ".join(f"{r}: {Path(m.source).name}" for r, m in models.items()) + _quant_note(target.model))

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    V = target.config.vocab_size
    entries, written = {}, {}  # role -> its weights file's layout (write_weights)
    lists = {role: graph_list(role, cfg, quantized=bool(quant_layers(m.model))) for role, m in models.items()}
    work = [(role, g) for role in models for g in lists[role]]
    st.start("export", f"{len(work)} graphs x {', '.join(cfg.formats)}")
    bar = tqdm(total=len(work) * len(cfg.formats), disable=not progress, unit="graph", file=sys.stderr)
    for role, m in models.items():
        shared = shared_tensors(target.model, m.model) if role == "draft" else {}
        place = "target" if shared else role  # (see the folder layout above)
        prefix = f"{role}." if shared else ""
        folder = tmp / place
        folder.mkdir(exist_ok=True)
        graphs = lists[role]
        entry = {"source": m.source, "config": asdict(m.config), "kv_dtype": str(next(m.model.parameters()).dtype
                                                                               ).replace("torch.", ""),
                 "weights": f"{place}/{prefix}{WEIGHTS_FILE}", "graphs": {}, **m.record}
        if shared:  # (the target's weights were written first: written["target"] places them)
            entry["shared"] = {"file": f"target/{WEIGHTS_FILE}", "tensors": shared,
                               "bytes": sum(written["target"][t][2] for t in set(shared.values()))}  # (a
            # tensor the draft reads under two names, e.g. a tied embedding as the rescored head's, counts once)
        if role == "draft" and quant is not None:
            entry["quant"] = asdict(quant)
        layers = quant_layers(m.model)
        if layers:  # every quantized linear's layout, to rebuild the eager model (torch backend) from the file
            entry["quant_layers"] = layers
            if torch_formats:
                raise SpecExportError(f"the {role} has quantized layers (GGUF weights as stored), which export to "
                                      f"ONNX (MatMulNBits) only: drop {','.join(torch_formats)} from --format, or "
                                      "pass --dtype fp32 for a dequantized engine")
        weights = write_weights(m.model, folder / f"{prefix}{WEIGHTS_FILE}", skip=set(shared))  # (the torch
        written[role] = dict(weights)  # backend reads it too)
        weights.update({n: written["target"][t] for n, t in shared.items()})
        if "onnx" in cfg.formats:
            for name, kind, k, sampling in graphs:
                bar.set_description(f"{role} {name} (onnx)")
                infos = export_graph(m.model, kind, k, sampling, cfg.prefill_chunk, dec_cfg.cache_len, V, folder,
                                     weights, cfg.ops, prefix, rows=per_row_batches(cfg, role, kind, k))
                for gname, info in infos.items():
                    entry["graphs"][gname] = {**info, "file": f"{place}/{info['file']}"}
                bar.update()
        m.model.head_search = None  # (ONNX's fused graphs only: TorchScript and pt2 would carry its buffers)
        if "torchscript" in cfg.formats:
            bar.set_description(f"{role} (torchscript)")
            ts_graphs = graph_list(role, cfg, "portable")
            export_torchscript(m.model, ts_graphs, cfg.prefill_chunk, dec_cfg.cache_len, V,
                               folder / f"{prefix}{TORCHSCRIPT_FILE}")
            entry["torchscript"] = f"{place}/{prefix}{TORCHSCRIPT_FILE}"
            entry["torchscript_methods"] = [g[0] for g in ts_graphs]
            bar.update(len(graphs))
        if "pt2" in cfg.formats:
            entry["pt2"] = export_pt2_entry(m.model, role, graph_list(role, cfg, "portable"), cfg, dec_cfg.cache_len,
                                            V, folder, bar, place, prefix)
        entries[role] = entry
    bar.close()
    st.done()

    st.start("save", "tokenizer and manifest (sha256 of every file)")
    if target.tokenizer is not None:
        target.tokenizer.save_pretrained(str(tmp / "tokenizer"))
    import onnx
    import transformers
    manifest = {
        "specexport_version": __version__, "graph_code": graph_code(),
        "versions": {"torch": torch.__version__, "onnx": onnx.__version__, "transformers": transformers.__version__,
                     "opset": OPSET},
        "formats": list(cfg.formats), "ops": cfg.ops, "dtype": dec_cfg.dtype, "ks": sorted(cfg.ks),
        "weights": "dequantized" if cfg.dtype else "as stored", "target_quant": cfg.target_quant,
        "activations": cfg.activations,
        "max_batch": cfg.max_batch,
        "max_seq_len": cfg.max_seq_len, "prefill_chunk": cfg.prefill_chunk, "cache_len": dec_cfg.cache_len,
        "sampling_graphs": cfg.sampling, "drafter": "model" if "draft" in models else PROMPT_LOOKUP,
        "ngram": [dec_cfg.ngram_min, dec_cfg.ngram_max],
        "vocab_size": V, "eos_token_ids": list(target.config.eos_token_ids),
        "tokenizer": "tokenizer" if target.tokenizer is not None else None,
        "models": entries,
    }
    write_manifest(tmp, manifest)
    st.done(str(tmp))

    st.start("check", "engine tokens vs the eager torch backend (greedy)")
    checked = check_engine(tmp, models, cfg)  # a failing engine never replaces a good one
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    st.done(", ".join(checked) + f"; written to {out}")
    files = {rel: info["bytes"] for rel, info in manifest_files(out).items()}
    return {"out": str(out), "stages_s": st.times, "graphs": len(work), "formats": list(cfg.formats),
            "ks": sorted(cfg.ks), "files": files, "total_bytes": sum(files.values())}


def per_row_batches(cfg: BuildConfig, role: str, kind: str, k: int) -> tuple[int, ...]:
    """The batch sizes that get a per-row-attention variant of a graph (onnx_graphs.per_row_attention): a fused
    target's multi-token verify graphs and its exact target-only step, at every batch 2..min(max_batch,
    PER_ROW_MAX) (one graph file each; a larger batch runs in chunks). Without them a fused verify at batch B
    runs the graph once per row (ONNX Runtime's GroupQueryAttention refuses multi-token rows with a past at
    batch > 1); the exact step's variants serve `batch_invariant` loads."""
    if cfg.ops != "fused" or role != "target" or not (kind == "verify_exact" or (kind == "verify" and k > 0)):
        return ()
    return tuple(range(2, min(cfg.max_batch, PER_ROW_MAX) + 1))


def export_pt2_entry(model, role: str, graphs, cfg: BuildConfig, cache_len: int, V: int, folder: Path, bar,
                     place: str, prefix: str = "") -> dict:
    """AOTInductor-compile a role's graphs into folder/<prefix>steps.pt2 -> its manifest entry (the torch version
    that built it, which is the only one that can load it; seconds per graph)."""
    from .pt2 import PT2_FILE, export_pt2, pt2_cache_len, weight_aliases

    def on_graph(name):
        bar.set_description(f"{role} {name} (pt2)")
    seconds = export_pt2(model, graphs, cfg.prefill_chunk, cache_len, V, cfg.max_batch, folder / f"{prefix}{PT2_FILE}",
                         on_graph)
    bar.update(len(graphs))
    return {"file": f"{place}/{prefix}{PT2_FILE}", "graphs": [g[0] for g in graphs], "torch": torch.__version__,
            "device": "cpu", "cache_len": pt2_cache_len(cache_len), "aliases": weight_aliases(model),
            "compile_s": seconds}


def _quant_note(model) -> str:
    from ..models.quant import QuantLinear
    q = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if not q:
        return ""
    kinds = sorted({f"int{m.spec.bits}/b{m.spec.block_size}{'+min' if m.spec.mins else ''}" for m in q})
    return f"; target: {len(q)} quantized linears ({', '.join(kinds)})"


def manifest_files(root: Path) -> dict:
    import json
    return json.loads((root / MANIFEST).read_text())["files"]


def check_engine(out: Path, models: dict[str, LoadedModel], cfg: BuildConfig) -> list[str]:
    """Every built backend must give the eager torch tokens for a short greedy run at every k."""
    from ..runtime import SpeculativeDecoder
    from ..backends.torch_engine import TorchEngine
    from ..drafters import ModelDrafter, PromptLookupDrafter
    from ..models.quant import QuantLinear
    dec_cfg = cfg.decoder(max_batch=1)
    V = models["target"].config.vocab_size
    prompt = ([t % V for t in CHECK_PROMPT] * 2)[:max(1, cfg.max_seq_len // 2)]  # repeats: lookup finds drafts
    n = min(16, cfg.max_seq_len - len(prompt))
    checked = []
    if any(isinstance(m, QuantLinear) and m.spec.accuracy_level != 0 for m in models["target"].model.modules()):
        # int8 activations: ONNX Runtime's kernel, not the eager matmul, defines the target; the engine's own
        # target-only tokens are the reference (lossless: speculative equals target-only, token for token)
        eng = SpeculativeDecoder.load(str(out), backend="onnxruntime", max_batch=1, verify_hashes=False)
        want = eng.generate(prompt, n, speculative=False)[0].token_ids
        for k in cfg.ks:
            got = eng.generate(prompt, n, k=k)[0].token_ids
            if got != want:
                raise SpecExportError(f"built engine check failed: onnxruntime at k={k} gave {got[:8]}..., its "
                                      f"target-only steps {want[:8]}...; please report this with the build command")
        return ["onnxruntime ok (speculative = target-only, int8 activations)"]
    ref_engine = TorchEngine(models["target"].model, 1, dec_cfg.cache_len)
    drafter = (ModelDrafter(TorchEngine(models["draft"].model, 1, dec_cfg.cache_len, target_vocab=V), "draft")
               if "draft" in models else PromptLookupDrafter(dec_cfg.ngram_min, dec_cfg.ngram_max))
    ref = SpeculativeDecoder(ref_engine, drafter, dec_cfg)
    want = {k: ref.generate(prompt, n, k=k)[0].token_ids for k in cfg.ks}
    for backend in [b for f, b in (("onnx", "onnxruntime"), ("torchscript", "torchscript"), ("pt2", "pt2"))
                    if f in cfg.formats]:
        if dec_cfg.dtype != "fp32":  # half precision: kernels round differently, so tokens may legitimately differ
            checked.append(f"{backend} not compared ({dec_cfg.dtype})")
            continue
        eng = SpeculativeDecoder.load(str(out), backend=backend, max_batch=1, verify_hashes=False)
        for k, tokens in want.items():
            got = eng.generate(prompt, n, k=k)[0].token_ids
            if got != tokens:
                raise SpecExportError(f"built engine check failed: {backend} at k={k} gave {got[:8]}..., the eager "
                                      f"torch backend {tokens[:8]}...; please report this with the build command")
        checked.append(f"{backend} ok")
    return checked
