"""`specexport bench --peers`: the side-by-side report (ratios, fidelity, lossless counts) from hand-made
records, and the one-line errors of its options."""

import pytest

from specexport.bench.versus import markdown, summarize
from specexport.cli import main


def _result():
    systems = [("hf_generate", "fp32", None), ("se-fp32/target-only", "fp32", None),
               ("se-fp32/lookup@auto", "fp32", "se-fp32/target-only"), ("se-gguf/target-only", "4-bit", None),
               ("se-gguf/lookup@auto", "4-bit", "se-gguf/target-only"), ("llama.cpp", "4-bit", None),
               ("ort-genai-fp32", "fp32", None), ("ort-genai-fp32+ngram4", "fp32", "ort-genai-fp32"),
               ("se-fp32-int8/hybrid@auto", "fp32", "se-fp32/target-only")]
    rates = {"hf_generate": 20, "se-fp32/target-only": 40, "se-fp32/lookup@auto": 80, "se-gguf/target-only": 150,
             "se-gguf/lookup@auto": 200, "llama.cpp": 100, "ort-genai-fp32": 50, "ort-genai-fp32+ngram4": 40,
             "se-fp32-int8/hybrid@auto": 90}
    records = []
    for i, cat in enumerate(["chat", "code_edit"]):
        toks = {n: [1, 2, 3] for n, _, _ in systems}
        toks["se-gguf/target-only"] = toks["se-gguf/lookup@auto"] = [1, 2, 4]  # 4-bit: differs from fp32
        if cat == "chat":
            toks["llama.cpp"] = [9]
        records.append({"id": str(i), "category": cat, "rep": 0, "prompt_tokens": 5,
                        "systems": {n: {"tokens": toks[n], "decode_tokens_per_s": rates[n] * (1 + i),
                                        "seconds": 1.0} for n, _, _ in systems}})
    return {"config": {"reps": 1, "max_new_tokens": 3, "threads": 2},
            "systems": [{"name": n, "group": g, "plain": p} for n, g, p in systems], "records": records}


def test_summary_ratios_and_fidelity():
    s = summarize(_result())
    t = {x["target"]: x for x in s["targets"]}
    assert t["fp32 target-only vs ORT GenAI fp32"]["ratio"] == pytest.approx(0.8)
    assert t["4-bit target-only (se-gguf) vs llama.cpp plain"]["ratio"] == pytest.approx(1.5)
    assert t["fp32 speculative (lookup@auto) vs ORT GenAI fp32, best mode"]["theirs"] == "ort-genai-fp32"  # best
    assert t["fp32 speculative (hybrid@auto) vs ORT GenAI fp32, best mode"]["ratio"] == pytest.approx(1.8)
    assert t["fp32 lookup@auto vs own target-only (min category >= 1.3)"]["min_category"] == pytest.approx(2.0)
    assert t["fp32 hybrid@auto vs own target-only (min category >= 1.3)"]["ratio"] == pytest.approx(2.25)
    assert s["same_as_hf"]["se-fp32/target-only"] == 2 and s["same_as_hf"]["se-gguf/target-only"] == 0
    assert s["same_as_hf"]["llama.cpp"] == 1
    assert s["same_as_plain"] == {"se-fp32/lookup@auto": 2, "se-gguf/lookup@auto": 2, "ort-genai-fp32+ngram4": 2,
                                  "se-fp32-int8/hybrid@auto": 2}
    md = markdown(_result(), s)
    assert "| se-gguf/target-only | 4-bit |" in md and "| 4-bit target-only (se-gguf) vs llama.cpp plain |" in md


def test_unknown_peer_is_a_one_line_error(capsys):
    assert main(["bench", "--peers", "vllm", "--prompts", __file__]) == 2
    err = capsys.readouterr().err
    assert "--peers vllm: choose from llama.cpp, ort-genai" in err and "Traceback" not in err


def test_run_orders_balance_position_and_predecessor():
    import collections
    from specexport.bench.report import run_order, williams_rows
    for n in (1, 2, 3, 4, 5, 15):
        rows = williams_rows(n)
        assert len(rows) == (2 * n if n % 2 else n)
        assert all(sorted(r) == list(range(n)) for r in rows)
        for pos in range(n):  # every mode at every position equally often
            assert len(set(collections.Counter(r[pos] for r in rows).values())) == 1
        follows = collections.Counter((a, b) for r in rows for a, b in zip(r, r[1:]))
        assert len(follows) == n * (n - 1) and len(set(follows.values())) <= 1  # every mode after every other
    names = ["a", "b", "c", "d"]
    assert [run_order(names, i) for i in (0, 4)] == [["a", "b", "d", "c"]] * 2
    assert run_order([], 3) == []
