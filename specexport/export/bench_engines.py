"""The benchmarks' engine folders: built once for the default model and reused while their manifest matches and
the code that builds graphs is unchanged (`graph_code`): `bench --drafts` (one fp32-target engine per drafter) and
`bench --peers` (VERSUS_ENGINES)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..config import PROMPT_LOOKUP, BuildConfig, QuantSpec, is_quant_spec


BENCH_DRAFTS = ("quant:int8:b128:asym", "quant:int4:b32:asym")
# The widths the benchmarks' engines are built with (k="auto" chooses among them per step). On the 2-core AVX-512
# hosts an fp32 verify over 12 rows (k = 11) costs what the 9-row one does (1.46-1.47 target-only steps; stop 32:
# 12 rows cheaper than 11), and the fp32 hybrid at auto read 1.057x with it (README, stop 52).
BENCH_KS = (2, 4, 8, 11)


def bench_engine(spec: str, ks: tuple[int, ...], folder: Path, progress: bool) -> str:
    """An engine folder for one drafter (reused when its manifest already matches), built for batch 1."""
    from .build import build
    name = QuantSpec.parse(spec).name if is_quant_spec(spec) else spec
    out = folder / name.replace(":", "-")
    m = current_manifest(out)
    if m:
        if m.get("ks") == sorted(ks) and m["models"].get("draft", {}).get("source") == name and m["max_batch"] == 1 \
                and m.get("weights") == "dequantized":
            return str(out)
    print(f"[bench] building the engine for draft {name} (k {','.join(map(str, ks))}) in {out}", file=sys.stderr)
    build(BuildConfig(draft=spec, ks=ks, max_seq_len=1024, max_batch=1, sampling=False, dtype="fp32", out=str(out)),
          progress)  # the fp32 target, as before (the GGUF-as-stored target is `bench --peers`' se-gguf)
    return str(out)


VERSUS_ENGINES = {"se-fp32": dict(dtype="fp32"), "se-gguf": {}, "se-int4": dict(target_quant="int4:b32:sym"),
                  "se-gguf-fp32act": dict(activations="fp32"),
                  # the fp32 target with the int8 copy as its draft: the hybrid (lookup + the copy over the
                  # target's cache), the fastest lossless fp32 mode
                  "se-fp32-int8": dict(dtype="fp32", draft="quant:int8:b128:asym")}


def current_manifest(out: Path) -> dict | None:
    """The manifest of an engine folder the benchmarks may reuse: one this code would build the same way
    (its `graph_code` fingerprint matches); None when absent or built by other code."""
    from ..manifest import MANIFEST, graph_code
    if not (out / MANIFEST).exists():
        return None
    m = json.loads((out / MANIFEST).read_text())
    if m.get("graph_code") != graph_code():
        print(f"[bench] {out} was built by other graph code: rebuilding it", file=sys.stderr)
        return None
    return m


def versus_engine(label: str, ks: tuple[int, ...], folder: Path) -> str:
    """One of the peer comparison's engines of the default model (reused when its manifest matches)."""
    from .build import build
    opts = VERSUS_ENGINES[label]
    cfg = BuildConfig(ks=ks, max_seq_len=1024, max_batch=1, sampling=False, out=str(folder / label), **opts)
    out = folder / label
    m = current_manifest(out)
    if m:
        draft = m["models"].get("draft", {}).get("source", PROMPT_LOOKUP)
        want = QuantSpec.parse(cfg.draft).name if is_quant_spec(cfg.draft) else cfg.draft  # (as the manifest names it)
        if (m.get("ks"), m["max_batch"], m.get("ops"), m.get("weights"), m.get("activations"), m.get("target_quant"),
                draft) == (sorted(ks), 1, cfg.ops, "dequantized" if cfg.dtype else "as stored", cfg.activations,
                           cfg.target_quant, want):
            return str(out)
    print(f"[bench] building {label} (k {','.join(map(str, ks))}) in {out}", file=sys.stderr)
    build(cfg, True)
    return str(out)
