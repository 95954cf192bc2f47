"""`specexport bench` end to end on a tiny model with a tokenizer: every mode runs, the tokens match
transformers, and the report (JSON, Markdown, PNG plots) is written."""

import json

import pytest

from helpers import make_tiny, word_tokenizer
from specexport.bench.report import summarize
from specexport.bench.runner import read_prompts
from specexport.cli import main
from specexport.config import BuildConfig
from specexport.errors import SpecExportError
from specexport.export.build import build

WORDS = [f"w{i}" for i in range(96)]


@pytest.fixture(scope="module")
def bench_setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    make_tiny(d / "t", "llama", seed=4, tokenizer=word_tokenizer(WORDS), logit_scale=4.0, tie_word_embeddings=False)
    engine = build(BuildConfig(target=str(d / "t"), draft="quant:int8", ks=(2, 3), max_seq_len=64, max_batch=1,
                               prefill_chunk=16, sampling=False, out=str(d / "e")), progress=False)["out"]
    prompts = d / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"{c}-{i}", "category": c, "prompt": " ".join(WORDS[i:i + 9] * 2)})
                                 for i, c in ((3, "copy"), (20, "copy"), (40, "other"))) + "\n")
    return d, engine, prompts


def test_bench_runs_every_mode_and_writes_the_report(bench_setup, capsys):
    d, engine, prompts = bench_setup
    out = d / "out"
    assert main(["bench", "--engine", engine, "--prompts", str(prompts), "--max-new-tokens", "8",
                 "--per-category", "1", "--out", str(out)]) == 0
    md = capsys.readouterr().out
    result = json.loads((out / "bench.json").read_text())
    modes = [m["name"] for m in result["modes"]]
    assert modes == ["hf_generate", "hf_prompt_lookup", "hf_assistant_int8", "target_only",
                     "prompt-lookup@k2", "prompt-lookup@k3", "prompt-lookup@auto",
                     "quant:int8:b32:asym@k2", "quant:int8:b32:asym@k3", "quant:int8:b32:asym@auto"]
    assert [r["id"] for r in result["records"]] == ["copy-3", "other-40"]  # --per-category 1
    for r in result["records"]:  # lossless: every mode gives transformers' greedy tokens
        assert all(r["identical"].values()), r["identical"]
    s = result["summary"]
    assert set(s["table"]) == {"copy", "other", "all"}
    cell = s["table"]["all"]["quant:int8:b32:asym@k3"]
    for key in ("tokens_per_s", "acceptance", "acceptance_mle", "tokens_per_step", "predicted", "measured"):
        assert cell[key] > 0, key
    assert set(s["best"]) == {"copy", "other"} and s["best_per_category_geomean_x"] > 0
    for f in ("bench.md", "speedup_vs_k.png", "accept_hist.png"):
        assert (out / f).stat().st_size > 0
    assert "Leviathan" in md and "| quant:int8:b32:asym@k3 |" in md
    assert summarize(result)["modes"] == modes


def test_bench_input_errors(bench_setup, tmp_path, capsys):
    d, engine, _ = bench_setup
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "category": "x"}\n')
    assert main(["bench", "--engine", engine, "--prompts", str(bad), "--hf", "none"]) == 2
    err = capsys.readouterr().err
    assert "needs a non-empty string 'prompt'" in err and "Traceback" not in err
    assert main(["bench", "--engine", engine, "--prompts", str(tmp_path / "missing.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["bench", "--engine", engine, "--prompts", str(bad), "--hf", "vllm"]) == 2
    assert "--hf 'vllm'" in capsys.readouterr().err
    with pytest.raises(SpecExportError, match="not JSON"):
        (tmp_path / "nj.jsonl").write_text("{nope\n")
        read_prompts(str(tmp_path / "nj.jsonl"))
