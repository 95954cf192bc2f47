"""A damaged, incomplete or mismatched engine folder gets one clear error, never wrong tokens."""

import json
import shutil

import pytest

from specexport import SpeculativeDecoder, SpecExportError
from specexport.config import BuildConfig
from specexport.export.build import build


@pytest.fixture
def copy(engines, tmp_path):
    dst = tmp_path / "engine"
    shutil.copytree(engines["qwen2"], dst)
    return dst


def flip_byte(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("backend", ["onnxruntime", "torch", "torchscript"])
@pytest.mark.parametrize("rel", ["target/verify_k3_greedy.onnx", "target/weights.safetensors",
                                 "draft/steps.torchscript.pt", "draft/draft_k1_sample.onnx"])
def test_corrupted_file(copy, rel, backend):
    path = copy / rel
    if not path.exists():
        pytest.skip(f"{rel} is not in this engine")
    flip_byte(path, path.stat().st_size // 2)
    with pytest.raises(SpecExportError, match=rf"engine file {rel} is damaged \(sha256 differs"):
        SpeculativeDecoder.load(str(copy), backend=backend)


def test_truncated_file(copy):
    path = copy / "draft/weights.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(SpecExportError, match=r"draft/weights.safetensors is damaged \(\d+ bytes, the manifest says"):
        SpeculativeDecoder.load(str(copy))


def test_missing_file(copy):
    (copy / "target/prefill.onnx").unlink()
    with pytest.raises(SpecExportError, match="engine file target/prefill.onnx is missing"):
        SpeculativeDecoder.load(str(copy))


@pytest.mark.parametrize("edit,match", [
    (lambda m: m.update(format_version=99), "engine format version 99, this specexport reads version 1"),
    (lambda m: m.update(format="something-else"), "not a specexport engine manifest"),
    (lambda m: m.pop("ks"), "has no 'ks' entry"),
])
def test_manifest_mismatch(copy, edit, match):
    m = json.loads((copy / "manifest.json").read_text())
    edit(m)
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(SpecExportError, match=match):
        SpeculativeDecoder.load(str(copy))


def test_not_an_engine_folder(tmp_path):
    with pytest.raises(SpecExportError, match="is not an engine folder"):
        SpeculativeDecoder.load(str(tmp_path))
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(SpecExportError, match="manifest.json is damaged"):
        SpeculativeDecoder.load(str(tmp_path))
    with pytest.raises(SpecExportError, match="does not exist"):
        SpeculativeDecoder.load(str(tmp_path / "nope"))


def test_incompatible_pair_fails_before_any_export(tiny, tmp_path):
    from helpers import make_tiny
    other = make_tiny(tmp_path / "other_vocab", "llama", seed=3, vocab_size=64)
    assert other is not None
    out = tmp_path / "never"
    with pytest.raises(SpecExportError, match="draft vocabulary size 64 differs from the target's 96"):
        build(BuildConfig(target=tiny["llama"]["target"], draft=str(tmp_path / "other_vocab"), out=str(out),
                          max_seq_len=64, max_batch=1, prefill_chunk=8))
    assert not out.exists() and not (tmp_path / "never.partial").exists()


def test_out_must_be_an_engine_folder_or_new(tiny, tmp_path):
    (tmp_path / "mine.txt").write_text("precious")
    with pytest.raises(SpecExportError, match="exists and is not an engine folder"):
        build(BuildConfig(target=tiny["llama"]["target"], out=str(tmp_path), max_seq_len=64, max_batch=1,
                          prefill_chunk=8))
    assert (tmp_path / "mine.txt").read_text() == "precious"


def test_graph_shapes_must_match_the_manifest(copy):
    m = json.loads((copy / "manifest.json").read_text())
    m["prefill_chunk"] = 32  # built with 16
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(SpecExportError, match=r"graph prefill takes \['B', 16\] tokens, the manifest implies"):
        SpeculativeDecoder.load(str(copy))


def test_missing_graph_for_a_listed_k(copy):
    m = json.loads((copy / "manifest.json").read_text())
    m["ks"] = [1, 2, 3]
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(SpecExportError, match="engine target has no verify_k2_greedy graph although it lists k=2"):
        SpeculativeDecoder.load(str(copy))
