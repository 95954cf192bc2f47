"""`specexport build`: load a target/draft pair, export their step graphs, save the engine folder, check it.

Folder layout:
  manifest.json            see manifest.py
  tokenizer/               the target's tokenizer (save_pretrained)
  target/weights.safetensors, target/<graph>.onnx, target/steps.torchscript.pt
  draft/...                the same for a draft model (none for prompt lookup)
Stages: load (and check the pair), export, save, check (the engine must give the eager torch tokens).
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from .. import __version__
from ..config import PROMPT_LOOKUP, BuildConfig
from ..drafters import load_draft
from ..errors import SpecExportError
from ..models import LoadedModel, load_model, read_config, resolve_path
from ..models.quant import QuantSpec, is_quant_spec
from ..steps import graph_name
from .manifest import MANIFEST, write_manifest
from .onnx_graphs import OPSET, WEIGHTS_FILE, export_graph, write_weights
from .torchscript import export_torchscript

TORCHSCRIPT_FILE = "steps.torchscript.pt"
CHECK_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]  # token ids: every vocabulary has them


def graph_list(role: str, cfg: BuildConfig) -> list[tuple[str, str, int, bool]]:
    """(name, kind, k, sampling) of every graph a role gets."""
    modes = (False, True) if cfg.sampling else (False,)
    kind, ks = ("verify", (0, *cfg.ks)) if role == "target" else ("draft", cfg.ks)
    return [("prefill", "prefill", 0, False)] + [(graph_name(kind, k, s), kind, k, s) for k in ks for s in modes]


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
    if quant is not None and "torchscript" in cfg.formats:
        raise SpecExportError(f"draft {cfg.draft!r} exports to ONNX (MatMulNBits) only; TorchScript has no "
                              "low-bit kernel: drop torchscript from --format, or use a draft model")
    for spec, role in ((cfg.target, "target"), (cfg.draft, "draft")):
        if spec != PROMPT_LOOKUP and not is_quant_spec(spec):
            read_config(resolve_path(spec, role))
    st = _Stages(progress)

    st.start("load", "loading the models and checking the pair")
    target = load_model(cfg.target, cfg.dtype, dec_cfg.cache_len, role="target")
    models: dict[str, LoadedModel] = {"target": target}
    if cfg.draft != PROMPT_LOOKUP:
        models["draft"] = load_draft(cfg.draft, target, dec_cfg)  # an unfit draft fails here, before any export
    st.done(", ".join(f"{r}: {Path(m.source).name}" for r, m in models.items()))

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    V = target.config.vocab_size
    entries = {}
    work = [(role, g) for role in models for g in graph_list(role, cfg)]
    st.start("export", f"{len(work)} graphs x {', '.join(cfg.formats)}")
    bar = tqdm(total=len(work) * len(cfg.formats), disable=not progress, unit="graph", file=sys.stderr)
    for role, m in models.items():
        folder = tmp / role
        folder.mkdir()
        graphs = graph_list(role, cfg)
        entry = {"source": m.source, "config": asdict(m.config), "kv_dtype": str(next(m.model.parameters()).dtype
                                                                               ).replace("torch.", ""),
                 "weights": f"{role}/{WEIGHTS_FILE}", "graphs": {}}
        if role == "draft" and quant is not None:
            entry["quant"] = asdict(quant)
        if "onnx" in cfg.formats:
            offsets = write_weights(m.model, folder / WEIGHTS_FILE)
            for name, kind, k, sampling in graphs:
                bar.set_description(f"{role} {name} (onnx)")
                info = export_graph(m.model, kind, k, sampling, cfg.prefill_chunk, dec_cfg.cache_len, V, folder,
                                    offsets)
                entry["graphs"][name] = {**info, "file": f"{role}/{info['file']}"}
                bar.update()
        else:
            write_weights(m.model, folder / WEIGHTS_FILE)  # the torch backend reads it
        if "torchscript" in cfg.formats:
            bar.set_description(f"{role} (torchscript)")
            export_torchscript(m.model, graphs, cfg.prefill_chunk, dec_cfg.cache_len, V, folder / TORCHSCRIPT_FILE)
            entry["torchscript"] = f"{role}/{TORCHSCRIPT_FILE}"
            entry["torchscript_methods"] = [g[0] for g in graphs]
            bar.update(len(graphs))
        entries[role] = entry
    bar.close()
    st.done()

    st.start("save", "tokenizer and manifest (sha256 of every file)")
    if target.tokenizer is not None:
        target.tokenizer.save_pretrained(str(tmp / "tokenizer"))
    import onnx
    import transformers
    manifest = {
        "specexport_version": __version__,
        "versions": {"torch": torch.__version__, "onnx": onnx.__version__, "transformers": transformers.__version__,
                     "opset": OPSET},
        "formats": list(cfg.formats), "dtype": cfg.dtype, "ks": sorted(cfg.ks), "max_batch": cfg.max_batch,
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


def manifest_files(root: Path) -> dict:
    import json
    return json.loads((root / MANIFEST).read_text())["files"]


def check_engine(out: Path, models: dict[str, LoadedModel], cfg: BuildConfig) -> list[str]:
    """Every built backend must give the eager torch tokens for a short greedy run at every k."""
    from ..runtime import SpeculativeDecoder
    from ..backends.torch_engine import TorchEngine
    from ..drafters import ModelDrafter, PromptLookupDrafter
    dec_cfg = cfg.decoder(max_batch=1)
    V = models["target"].config.vocab_size
    ref_engine = TorchEngine(models["target"].model, 1, dec_cfg.cache_len)
    drafter = (ModelDrafter(TorchEngine(models["draft"].model, 1, dec_cfg.cache_len, target_vocab=V), "draft")
               if "draft" in models else PromptLookupDrafter(dec_cfg.ngram_min, dec_cfg.ngram_max))
    ref = SpeculativeDecoder(ref_engine, drafter, dec_cfg)
    prompt = ([t % V for t in CHECK_PROMPT] * 2)[:max(1, cfg.max_seq_len // 2)]  # repeats: lookup finds drafts
    n = min(16, cfg.max_seq_len - len(prompt))
    want = {k: ref.generate(prompt, n, k=k)[0].token_ids for k in cfg.ks}
    checked = []
    for backend in [b for f, b in (("onnx", "onnxruntime"), ("torchscript", "torchscript")) if f in cfg.formats]:
        if cfg.dtype != "fp32":  # half precision: kernels round differently, so tokens may legitimately differ
            checked.append(f"{backend} not compared ({cfg.dtype})")
            continue
        eng = SpeculativeDecoder.load(str(out), backend=backend, max_batch=1, verify_hashes=False)
        for k, tokens in want.items():
            got = eng.generate(prompt, n, k=k)[0].token_ids
            if got != tokens:
                raise SpecExportError(f"built engine check failed: {backend} at k={k} gave {got[:8]}..., the eager "
                                      f"torch backend {tokens[:8]}...; please report this with the build command")
        checked.append(f"{backend} ok")
    return checked
