"""`specexport bench` end to end on a tiny model with a tokenizer: every mode runs, the tokens match
transformers, and the report (JSON, Markdown, PNG plots) is written."""

import json

import pytest

from helpers import make_tiny, word_tokenizer
from specexport.bench.report import auto_vs_fixed, summarize
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
                 "--per-category", "1", "--reps", "2", "--out", str(out)]) == 0
    md = capsys.readouterr().out
    result = json.loads((out / "bench.json").read_text())
    modes = [m["name"] for m in result["modes"]]
    q8 = "quant:int8:b32:asym:smooth0.6:head4"  # (a quant: copy is smoothed, its head rescored, by default)
    assert modes == ["hf_generate", "hf_prompt_lookup", "hf_assistant_int8", "target_only", "target_only_again",
                     "prompt-lookup@k2", "prompt-lookup@k3", "prompt-lookup@auto", f"{q8}@k2", f"{q8}@k3", f"{q8}@auto",
                     f"prompt-lookup+{q8}@k2", f"prompt-lookup+{q8}@k3", f"prompt-lookup+{q8}@auto"]
    assert [r["id"] for r in result["records"]] == ["copy-3", "other-40"]  # --per-category 1
    for r in result["records"]:  # lossless: every mode gives transformers' greedy tokens
        assert all(r["identical"].values()), r["identical"]
    s = result["summary"]
    assert set(s["table"]) == {"copy", "other", "all"}
    cell = s["table"]["all"][f"{q8}@k3"]
    for key in ("tokens_per_s", "acceptance", "acceptance_mle", "tokens_per_step", "predicted", "measured"):
        assert cell[key] > 0, key
    assert set(s["best"]) == {"copy", "other"} and s["best_per_category_geomean_x"] > 0
    per_pos = cell["acceptance_per_pos"]  # vLLM's per-position acceptance: k values, each a share
    assert len(per_pos) == 3 and all(0 <= x <= 1 for x in per_pos) and "acceptance at draft position" in md
    for f in ("bench.md", "speedup_vs_k.png", "accept_hist.png", "acceptance_per_pos.png"):
        assert (out / f).stat().st_size > 0
    assert "Leviathan" in md and f"| {q8}@k3 |" in md
    assert summarize(result)["modes"] == modes
    # --reps 2: every mode ran twice per prompt; the k=auto section has per-prompt ratios
    rec = result["records"][0]["modes"]
    assert len(rec["prompt-lookup@auto"]["decode_rates"]) == 2 and rec["target_only"]["stats"]["new_tokens"] == 16
    auto = s["auto"]["prompt-lookup@auto"]
    assert [r["id"] for r in auto["rows"]] == ["copy-3", "other-40"]
    assert auto["min_over_target_only"] == min(r["auto_over_target_only"] for r in auto["rows"]) > 0
    assert auto["geomean_over_best_fixed"] > 0 and auto["rows"][0]["best_fixed"].startswith("prompt-lookup@k")
    assert auto["geomean_over_best_fixed_held_out"] > 0 and "... held out" in md  # (--reps 2)
    # the one fixed k a deployment could have fixed (the best geometric mean over prompts)
    single = auto["best_single_fixed"]
    assert single in auto["rows"][0]["auto_over_fixed"] and auto["geomean_over_best_single_fixed"] > 0
    assert "geomean auto / best single k" in md
    assert "min auto / target-only" in md and "| copy-3 | copy |" in md
    assert s["auto"]["target_only_again"]["min_over_target_only"] > 0  # the A/A control row


def test_auto_over_best_fixed_k_held_out_is_free_of_the_winners_curse():
    """Hand-forced rates, 2 repetitions: two fixed ks as fast as auto on average whose runs scatter. In hindsight
    the fastest k per prompt is the lucky one (auto / best fixed k < 1 though no k is better); held out, the k chosen
    on one repetition is timed on the other."""
    def mode(name, k):
        return {"name": name, "drafter": "prompt-lookup" if k != 0 else "none", "k": k}

    def rec(auto, k2, k4):
        rates = {"target_only": [5.0, 5.0], "prompt-lookup@auto": auto, "prompt-lookup@k2": k2, "prompt-lookup@k4": k4}
        return {"id": "p", "category": "c", "modes": {n: {"decode_rates": r, "stats": {"k_steps": {}}}
                                                      for n, r in rates.items()}}
    result = {"modes": [mode("target_only", 0), mode("prompt-lookup@k2", 2), mode("prompt-lookup@k4", 4),
                        mode("prompt-lookup@auto", "auto")],
              "records": [rec([10.0, 10.0], [12.0, 9.0], [9.0, 12.0])]}
    cell = auto_vs_fixed(result)["prompt-lookup@auto"]
    row = cell["rows"][0]
    # hindsight: k2 and k4 both have median 10.5; k2 (the first) is taken, auto / k2 per run 10/12, 10/9
    assert row["best_fixed"] == "prompt-lookup@k2" and abs(row["auto_over_best_fixed"] - (10 / 12 + 10 / 9) / 2) < 1e-9
    # held out: run 0 takes k4 (faster in run 1) and times it at 9; run 1 takes k2 (faster in run 0), also 9
    assert abs(row["auto_over_best_fixed_held_out"] - 10 / 9) < 1e-9
    assert abs(cell["geomean_over_best_fixed_held_out"] - 10 / 9) < 1e-9
    one = {"modes": result["modes"], "records": [rec([10.0], [12.0], [9.0])]}  # one repetition: not defined
    assert "geomean_over_best_fixed_held_out" not in auto_vs_fixed(one)["prompt-lookup@auto"]
    one["records"][0]["modes"]["target_only"]["decode_rates"] = [5.0]
    assert "auto_over_best_fixed_held_out" not in auto_vs_fixed(one)["prompt-lookup@auto"]["rows"][0]


def test_bench_under_load(bench_setup, capsys):
    """--clients: the continuous batcher at each client count, target-only, auto and a fixed k, same tokens."""
    d, engine, prompts = bench_setup
    out = d / "load"
    assert main(["bench", "--clients", "1,2", "--engine", engine, "--prompts", str(prompts), "--requests", "3",
                 "--max-new-tokens", "6", "--load-k", "auto,2", "--out", str(out)]) == 2  # built for max_batch 1
    assert "max_batch" in capsys.readouterr().err
    big = build(BuildConfig(target=str(d / "t"), ks=(2, 3), max_seq_len=64, max_batch=2, prefill_chunk=16,
                            sampling=False, out=str(d / "e2")), progress=False)["out"]
    assert main(["bench", "--clients", "1,2", "--engine", big, "--prompts", str(prompts), "--requests", "3",
                 "--max-new-tokens", "6", "--load-k", "auto,2", "--out", str(out)]) == 0
    result = json.loads((out / "load.json").read_text())
    assert [lv["clients"] for lv in result["levels"]] == [1, 2]
    for lv in result["levels"]:
        assert set(lv["modes"]) == {"target_only", "target_only_aa", "k=auto", "k=2"}  # with the A/A control
        assert all(c["identical"] and c["tokens_per_s"] > 0 for c in lv["modes"].values())
        assert lv["modes"]["target_only"]["x_per_rep"] == [1.0]
        assert set(lv["modes"]["target_only_aa"]["k_steps"]) == {"0"}  # target-only through its own batcher
    assert "| 2 |" in capsys.readouterr().out
    assert main(["bench", "--clients", "1,2", "--engine", big, "--prompts", str(prompts), "--requests", "0"]) == 2
    err = capsys.readouterr().err
    assert "--requests takes a count >= 1" in err and "Traceback" not in err


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


def test_bench_times_other_backends_beside_onnxruntime(tmp_path, capsys):
    """--backends: the first engine on torch and torchscript too (a pt2 engine takes minutes to compile; pt2 rows
    are the same code), rows named <mode>[<backend>], tokens identical to the reference."""
    make_tiny(tmp_path / "t", "llama", seed=4, tokenizer=word_tokenizer(WORDS), logit_scale=4.0,
              tie_word_embeddings=False)
    engine = build(BuildConfig(target=str(tmp_path / "t"), ks=(2,), max_seq_len=64, max_batch=1, prefill_chunk=16,
                               sampling=False, formats=("onnx", "torchscript"), out=str(tmp_path / "e")),
                   progress=False)["out"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "category": "copy", "prompt": " ".join(WORDS[3:12] * 2)}) + "\n")
    assert main(["bench", "--engine", engine, "--prompts", str(prompts), "--max-new-tokens", "8", "--hf", "none",
                 "--no-auto", "--backends", "torch,torchscript", "--out", str(tmp_path / "out")]) == 0
    md = capsys.readouterr().out
    result = json.loads((tmp_path / "out" / "bench.json").read_text())
    names = [m["name"] for m in result["modes"]]
    assert names[-4:] == ["target_only[torch]", "prompt-lookup@k2[torch]", "target_only[torchscript]",
                          "prompt-lookup@k2[torchscript]"]
    assert all(result["records"][0]["identical"].values())
    assert "| target_only[torch] |" in md
    assert main(["bench", "--engine", engine, "--prompts", str(prompts), "--backends", "tensorrt"]) == 2
    assert "'tensorrt' is not a backend" in capsys.readouterr().err


def test_benchmarks_rebuild_engines_built_by_other_graph_code(tmp_path, capsys):
    """`bench` reuses an engine folder only when the code that builds graphs is unchanged (the manifest's
    graph_code), so a benchmark never times graphs an older build wrote."""
    import json
    from specexport.export.bench_engines import current_manifest
    from specexport.manifest import graph_code
    assert current_manifest(tmp_path) is None
    (tmp_path / "manifest.json").write_text(json.dumps({"graph_code": graph_code(), "ks": [2]}))
    assert current_manifest(tmp_path)["ks"] == [2]
    (tmp_path / "manifest.json").write_text(json.dumps({"graph_code": "0" * 16, "ks": [2]}))
    assert current_manifest(tmp_path) is None
    assert "built by other graph code" in capsys.readouterr().err
    assert len(graph_code()) == 16 and graph_code() == graph_code()
    # ... and it fingerprints the graph-building sources themselves (a moved module must not leave it hashing none)
    from specexport.manifest import graph_sources
    names = {rel for rel, _ in graph_sources()}
    assert {"steps.py", "graphs.py", "export/build.py", "export/onnx_graphs.py", "models/decoder.py"} <= names
