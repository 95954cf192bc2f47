"""tools/gpu_selftest.py: without CUDA it says so and exits 0; `--cpu` runs its whole table on the CPU (tiny
models, FakeRuntime for the graphs); its imports need only torch and numpy (no transformers)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import load_tool

TOOL = Path(__file__).resolve().parents[1] / "tools" / "gpu_selftest.py"


@pytest.fixture(scope="module")
def selftest():
    return load_tool("gpu_selftest")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_without_cuda_says_so_and_exits_0(selftest, capsys):
    assert selftest.main([]) == 0
    assert "CUDA is not available" in capsys.readouterr().out


def test_cpu_dry_run_prints_the_table(selftest, capsys):
    status, rows = selftest.run(["--cpu", "--new", "8"])
    out = capsys.readouterr().out
    assert status == 0 and "all exactness checks passed" in out
    exact = [r for r in rows if r["check"] == "exact"]
    assert len(exact) == 2 * 2 * 2 * 5  # families x dtypes x graphs off/on x target-only/lookup/model/hybrid (k, auto)
    assert all(r["result"] == "ok" or r["result"].startswith("tie") for r in exact)
    assert sum(r["accepted"] for r in exact if r["mode"] == "model") > 0
    speed = [r for r in rows if r["check"] == "speed"]
    assert sorted((r["B"], r["graphs"], r["mode"]) for r in speed) == sorted(
        (B, g, m) for B in (1, 8) for g in ("off", "on") for m in ("target-only", "lookup"))
    assert all(r["result"] in out for r in speed)  # printed as one table
    assert all(r["same"] == f"{r['B']}/{r['B']}" for r in speed)  # speculative tokens = target-only's
    for backend in ("onnxruntime-gpu", "TensorRT"):
        assert backend in out or importlib.util.find_spec(backend.lower().replace("-gpu", "")) is not None


def test_imports_need_no_transformers():
    code = ("import importlib.util, sys; s = importlib.util.spec_from_file_location('t', sys.argv[1]); "
            "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); "
            "print(sorted(n for n in ('transformers', 'onnx', 'safetensors') if n in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(TOOL)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_hf_rows_match_transformers_on_the_same_weights(selftest):
    """--hf: transformers' generate and this runtime on one random Llama's weights; in fp32 the greedy tokens
    are transformers' own, plain and speculative."""
    rows = selftest.hf_rows(selftest.Setup(True), "tiny", 16, "fp32")
    assert [(r["model"], r["mode"]) for r in rows] == [
        ("tiny transformers", "plain"), ("tiny transformers", "lookup"), ("tiny specexport", "target-only"),
        ("tiny specexport", "lookup")]
    assert all(r["same"] == "=" for r in rows)


@pytest.mark.slow
def test_gguf_rows_match_transformers_on_the_real_model(selftest, smollm2_path, tmp_path):
    """--gguf: a trained model's GGUF through this runtime (FakeRuntime graphs here) against transformers over the
    same file, fp32: greedy tokens equal, target-only and prompt lookup."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "chat-1", "category": "chat", "prompt": "Say hello, then count to five."}\n')
    rows, ok = selftest.gguf_rows(selftest.Setup(True), smollm2_path, str(prompts), 1, 6)
    assert ok and [(r["model"], r["mode"]) for r in rows] == [
        ("SmolLM2-135M hf", "plain"), ("SmolLM2-135M hf", "lookup"), ("SmolLM2-135M ours", "target-only"),
        ("SmolLM2-135M ours", "lookup"), ("SmolLM2-135M ours", "lookup auto")]
    assert rows[0]["same"] == "ref" and all(r["same"] == "1/1" for r in rows[1:])
