"""The CLI: text out, stats, JSON, and one-line errors with a non-zero exit (no traceback)."""

import json
import subprocess
import sys

import pytest


def run(*args):
    return subprocess.run([sys.executable, "-m", "specexport.cli", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def texty(tmp_path_factory):
    from helpers import make_tiny, word_tokenizer
    d = tmp_path_factory.mktemp("texty")
    make_tiny(d / "t", "llama", seed=4, tokenizer=word_tokenizer([f"w{i}" for i in range(96)]), logit_scale=4.0,
              tie_word_embeddings=False)
    return str(d / "t")


def test_generate_json_and_compare(texty):
    r = run("generate", "--target", texty, "--prompt", "w1 w2 w3 w1 w2", "--max-new-tokens", "12", "--k", "3",
            "--max-seq-len", "64", "--json", "--compare")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["token_ids"]) == 12 and out["text"].startswith("w")
    assert out["identical_to_target_only"] is True and out["speedup"] > 0
    assert len(out["speedup_per_round"]) == 3  # --compare: 3 alternating rounds, the median quoted
    assert sorted(out["speedup_per_round"])[1] == out["speedup"]
    assert out["stats"]["k"] == 3 and len(out["stats"]["accept_hist"]) == 4
    r = run("generate", "--target", texty, "--prompt", "w1 w2 w3 w1 w2", "--max-new-tokens", "6", "--k", "3",
            "--max-seq-len", "64", "--compare", "1")
    assert r.returncode == 0 and "tokens identical]" in r.stderr and "rounds" not in r.stderr, r.stderr
    for bad in ("0", "-1"):
        r = run("generate", "--target", texty, "--prompt", "w1", "--max-seq-len", "64", "--compare", bad)
        assert r.returncode == 2 and "--compare takes a number of rounds" in r.stderr and "Traceback" not in r.stderr


def test_generate_stream_prints_text_and_stats(texty):
    r = run("generate", "--target", texty, "--prompt", "w5 w6 w7", "--max-new-tokens", "8", "--max-seq-len", "64",
            "--stream")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith("w") and "tok/s" in r.stderr and "accept histogram" in r.stderr


@pytest.mark.parametrize("args,msg", [
    (["--target", "/nonexistent/model"], "target path '/nonexistent/model' does not exist"),
    (["--k", "0"], "k must be >= 1"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--max-new-tokens", "100", "--max-seq-len", "16"], "> max_seq_len=16"),
])
def test_errors_are_one_line_without_traceback(texty, args, msg):
    base = ["generate", "--target", texty, "--prompt", "w1 w2", "--max-seq-len", "64"]
    r = run(*base, *args)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and msg in r.stderr
    assert r.stderr.strip().count("\n") == 0


def test_build_without_the_build_extra_is_one_clear_line(tmp_path):
    """A lean install (no torch): `specexport build` says which extra to install, in one line."""
    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None; "
            "from specexport.cli import main; sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, "build", "--out", str(tmp_path / "e")], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "needs the build extra" in r.stderr and "pip install 'specexport[build]'" in r.stderr
    assert r.stderr.strip().count("\n") == 0
