"""manifest.json: what an engine folder holds, and the checks that run before anything is loaded from it.

Records the format and specexport versions, the source models and their configs, dtype, k values,
max_batch, max_seq_len, the chunk size C, vocabulary size, EOS ids, the tokenizer directory, every
graph's inputs and outputs, and every file with its size and sha256.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .errors import SpecExportError

FORMAT = "specexport-engine"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


# the sources that decide what a built engine's graphs and weights are (package-relative)
GRAPH_SOURCES = ("config.py", "steps.py", "graphs.py", "verify.py", "sampling.py", "models", "export/build.py",
                 "export/onnx_graphs.py", "export/pt2.py", "export/torchscript.py", "draft_models.py")


def graph_code() -> str:
    """A fingerprint of the code that builds engines (recorded as the manifest's `graph_code`): the benchmarks
    rebuild an engine they would otherwise reuse when it differs, so they never time graphs an older build
    wrote."""
    from .version import __version__
    h = hashlib.sha256(__version__.encode())
    for rel, p in graph_sources():
        h.update(rel.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def graph_sources() -> list[tuple[str, Path]]:
    """The source files graph_code fingerprints: (path in the package, file); none in an install without sources
    (the version alone then)."""
    pkg = Path(__file__).resolve().parent  # the specexport package
    out = []
    for rel in GRAPH_SOURCES:
        for p in sorted((pkg / rel).rglob("*.py")) if (pkg / rel).is_dir() else [pkg / rel]:
            if p.is_file():
                out.append((str(p.relative_to(pkg)), p))
    return out


def file_table(root: Path) -> dict[str, dict]:
    """Every file under root (but the manifest): relative path -> {bytes, sha256}."""
    return {str(p.relative_to(root)): {"bytes": p.stat().st_size, "sha256": sha256(p)}
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != MANIFEST}


def write_manifest(root: Path, manifest: dict) -> None:
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, **manifest, "files": file_table(root)}
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def read_manifest(root: str | Path, verify_hashes: bool = True) -> dict:
    """Parse and check an engine folder; any problem is one SpecExportError naming the file and the fix."""
    root = Path(root)
    rebuild = "rebuild it with specexport build"
    if not root.is_dir():
        raise SpecExportError(f"engine folder {str(root)!r} does not exist: build one with specexport build")
    path = root / MANIFEST
    if not path.exists():
        raise SpecExportError(f"{str(root)!r} is not an engine folder (no {MANIFEST}): build one with specexport build")
    try:
        m = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecExportError(f"{path} is damaged ({e.__class__.__name__}: {e}): {rebuild}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise SpecExportError(f"{path} is not a specexport engine manifest: {rebuild}")
    if m.get("format_version") != FORMAT_VERSION:
        raise SpecExportError(f"{path} has engine format version {m.get('format_version')!r}, this specexport "
                              f"reads version {FORMAT_VERSION}: {rebuild}")
    for key in ("specexport_version", "dtype", "ks", "max_batch", "max_seq_len", "prefill_chunk", "cache_len",
                "models", "files", "drafter"):
        if key not in m:
            raise SpecExportError(f"{path} has no {key!r} entry: {rebuild}")
    for rel, info in m["files"].items():
        f = root / rel
        if not f.is_file():
            raise SpecExportError(f"engine file {rel} is missing from {root}: the folder is incomplete; {rebuild}")
        if f.stat().st_size != info["bytes"]:
            raise SpecExportError(f"engine file {rel} is damaged ({f.stat().st_size} bytes, the manifest says "
                                  f"{info['bytes']}): {rebuild}")
        if verify_hashes and sha256(f) != info["sha256"]:
            raise SpecExportError(f"engine file {rel} is damaged (sha256 differs from the manifest): {rebuild}")
    for role, entry in m["models"].items():
        for rel in [entry["weights"]] + [g["file"] for g in entry["graphs"].values()]:
            if rel not in m["files"]:
                raise SpecExportError(f"{path}: {role} file {rel} is not listed with a hash: {rebuild}")
    return m
