"""`specexport build | inspect | generate ENGINE_DIR` at the command line, errors included."""

import json

import pytest

from test_cli import run, texty  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def built(texty, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("cli") / "eng"
    r = run("build", "--target", texty, "--draft", "prompt-lookup", "--k", "2", "--k", "3,4", "--max-seq-len", "64",
            "--max-batch", "2", "--prefill-chunk", "8", "--format", "onnx,torchscript", "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr
    return out, json.loads(r.stdout)


def test_build_json_summary(built):
    out, summary = built
    assert summary["ks"] == [2, 3, 4] and summary["formats"] == ["onnx", "torchscript"]
    assert set(summary["stages_s"]) == {"load", "export", "save", "check"}
    assert "target/weights.safetensors" in summary["files"] and (out / "manifest.json").exists()


def test_build_shows_stages_with_timings(texty, tmp_path):  # noqa: F811
    r = run("build", "--target", texty, "--max-seq-len", "32", "--max-batch", "1", "--prefill-chunk", "8",
            "--greedy-only", "--out", str(tmp_path / "e"))
    assert r.returncode == 0, r.stderr
    for stage in ("load", "export", "save", "check"):
        assert f"[{stage}] done in" in r.stderr
    assert "engine written to" in r.stdout


def test_inspect(built):
    out, _ = built
    r = run("inspect", str(out))
    assert r.returncode == 0, r.stderr
    assert "k [2, 3, 4]" in r.stdout and "verify_k4_sample" in r.stdout and "memory for the pair" in r.stdout
    info = json.loads(run("inspect", str(out), "--json").stdout)
    assert info["memory"]["total_bytes"] == info["memory"]["weights_bytes"] + info["memory"]["kv_bytes_max_batch"]
    assert info["models"]["target"]["kv_shape"] == [2, 2, 64 + 4 + 1, 16]
    v = info["models"]["target"]["per_row_variants"]  # max_batch 2: a batch-2 variant of each verify graph
    assert v["batches"] == [2] and v["graphs"] == 8 and "per-row-attention variants: 8 graphs" in r.stdout
    assert "_rows2" not in r.stdout and not any("_rows" in g for g in info["models"]["target"]["graphs"])


@pytest.mark.parametrize("backend", ["onnxruntime", "torch", "torchscript"])
def test_generate_from_engine_matches_checkpoint(built, texty, backend):  # noqa: F811
    out, _ = built
    ref = json.loads(run("generate", "--target", texty, "--prompt", "w1 w2 w3 w1 w2", "--max-new-tokens", "10",
                         "--max-seq-len", "64", "--json").stdout)
    r = run("generate", str(out), "--backend", backend, "--prompt", "w1 w2 w3 w1 w2", "--max-new-tokens", "10",
            "--k", "3", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["token_ids"] == ref["token_ids"] and got["stats"]["k"] == 3


def test_generate_with_auto_k(built, texty):  # noqa: F811
    out, _ = built
    ref = json.loads(run("generate", "--target", texty, "--prompt", "w1 w2 w3 w1 w2", "--max-new-tokens", "10",
                         "--max-seq-len", "64", "--json").stdout)
    r = run("generate", str(out), "--prompt", "w1 w2 w3 w1 w2", "--max-new-tokens", "10", "--k", "auto", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["token_ids"] == ref["token_ids"] and got["stats"]["k"] == "auto"
    assert sum(got["stats"]["k_steps"].values()) == got["stats"]["steps"]
    r = run("generate", str(out), "--prompt", "w1", "--k", "many")
    assert r.returncode == 2 and "--k takes an integer or auto, got 'many'" in r.stderr and "Traceback" not in r.stderr


def test_generate_from_engine_streams(built):
    out, _ = built
    r = run("generate", str(out), "--prompt", "w5 w6 w7", "--max-new-tokens", "6", "--stream", "--temperature", "0.8",
            "--top-p", "0.9", "--seed", "3")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith("w") and "tok/s" in r.stderr


@pytest.mark.parametrize("args,msg", [
    (["generate", "{out}", "--prompt", "w1", "--k", "5", "--max-new-tokens", "4"], "k=5 has no graphs in this engine (built: 2, 3, 4)"),
    (["generate", "{out}", "--prompt", "w1", "--max-seq-len", "9"], "an engine folder fixes the models and shapes"),
    (["generate", "{out}/nope", "--prompt", "w1"], "does not exist"),
    (["generate", "--backend", "onnxruntime", "--prompt", "w1"], "runs engine folders"),
    (["inspect", "{out}/target"], "is not an engine folder"),
    (["build", "--k", "two", "--out", "{out}"], "--k takes integers"),
    (["build", "--format", "onnx,tflite", "--out", "{out}"], "unknown format tflite"),
    (["build", "--target", "/nonexistent", "--out", "{out}2"], "target path '/nonexistent' does not exist"),
])
def test_errors_are_one_line_without_traceback(built, args, msg):
    out, _ = built
    r = run(*[a.format(out=out) for a in args])
    assert r.returncode == 2, r.stdout
    assert "Traceback" not in r.stderr and msg in r.stderr, r.stderr
    assert r.stderr.strip().count("\n") == 0
