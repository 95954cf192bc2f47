"""tools/genai_perf_bench.py's table: with repetitions, each variant's figures are geometric means and each
repetition's spec / target-only ratio is listed; a run that failed is reported and not counted."""

from helpers import load_tool


def _tool():
    return load_tool("genai_perf_bench")


def _row(variant, clients, tps, rep, **extra):
    return {"server": "openai", "variant": variant, "clients": clients, "rep": rep, "output_tok_per_s": tps,
            "request_latency_p50_ms": 100.0, "ttft_p50_ms": 10.0, "itl_p50_ms": 5.0, "output_len_mean": 64.0,
            **extra}


def test_repetitions_are_merged_by_geometric_mean():
    tool = _tool()
    rows = [_row("spec", 16, 90.0, 1), _row("target", 16, 100.0, 1),
            _row("target", 16, 100.0, 2), _row("spec", 16, 110.0, 2),
            _row("spec", 1, 130.0, 1), _row("target", 1, 100.0, 1)]
    text, ratios = tool.table(rows)
    by = {r["clients"]: r for r in ratios}
    assert abs(by[16]["spec_over_target_tok_per_s"] - (90.0 * 110.0) ** 0.5 / 100.0) < 1e-9
    assert [round(x, 2) for x in by[16]["per_repetition"]] == [0.9, 1.1]
    assert abs(by[1]["spec_over_target_tok_per_s"] - 1.3) < 1e-9 and by[1]["per_repetition"] == [1.3]
    assert "0.99x (0.90, 1.10)" in text and "| openai | 1 | spec | 130.0 |" in text


def test_a_failed_repetition_is_reported_and_not_counted():
    tool = _tool()
    rows = [_row("spec", 4, 90.0, 1), _row("target", 4, 100.0, 1),
            {"server": "openai", "variant": "spec", "clients": 4, "rep": 2, "error": "perf_analyzer failed"},
            _row("target", 4, 80.0, 2), _row("spec", 4, 120.0, 3), _row("target", 4, 100.0, 3)]
    text, ratios = tool.table(rows)
    r = ratios[0]
    assert abs(r["spec_over_target_tok_per_s"] - (90.0 * 120.0) ** 0.5 / (100.0 * 80.0 * 100.0) ** (1 / 3)) < 1e-9
    assert [round(x, 2) for x in r["per_repetition"]] == [0.9, 1.2] and r["failed_runs"] == 1
    assert "(0.90, 1.20; 1 run(s) failed)" in text
    only_errors = [{"server": "triton", "variant": v, "clients": 16, "rep": 1, "error": "empty export"}
                   for v in ("spec", "target")]
    text, ratios = tool.table(only_errors)
    assert ratios[0]["spec_over_target_tok_per_s"] is None and "error: empty export" in text
