#!/usr/bin/env python
"""Load test of the specexport Triton model on loopback: 1, 4 and 16 concurrent streaming clients.

Writes a repository with the speculative model and a target-only one over the same engine, starts the
tritonserver from nvidia-pytriton, warms both up, then for each concurrency level runs both models in turn
(speculative, target-only) over the same requests (chat prompts from ../shared/bench/prompts.jsonl, greedy).
Reports throughput (generated tokens/s over the wall time), p50/p95 time to first token and p50/p95
total latency; writes JSON and Markdown.

    specexport build --max-seq-len 512 --max-batch 16 --out engines/smollm2-b16
    python tools/triton_bench.py engines/smollm2-b16 --prepack --out bench-results
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specexport.bench.load import run_clients  # noqa: E402
from specexport.triton.client import generate  # noqa: E402
from specexport.triton.repository import write_repository  # noqa: E402
from specexport.triton.server import start_server  # noqa: E402


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run_level(url, model, prompts, clients, max_tokens):
    results, lock = [], threading.Lock()
    work = list(enumerate(prompts))

    def client():
        while True:
            with lock:
                if not work:
                    return
                _, p = work.pop(0)
            r = generate(url, model, p, max_tokens=max_tokens, stream=True, chat=True)
            with lock:
                results.append(r)

    wall = run_clients(clients, client)
    errors = [r.error for r in results if r.error]
    tokens = sum(len(r.token_ids) for r in results)
    return {"clients": clients, "requests": len(results), "errors": errors, "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall,
            "ttft_p50_s": pct([r.ttft_s for r in results], 0.5), "ttft_p95_s": pct([r.ttft_s for r in results], 0.95),
            "latency_p50_s": pct([r.latency_s for r in results], 0.5),
            "latency_p95_s": pct([r.latency_s for r in results], 0.95),
            "acceptance_rate": statistics.mean(r.stats.get("acceptance_rate", 0) for r in results),
            "token_ids": [r.token_ids for r in results]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine")
    ap.add_argument("--prompts", default=str(ROOT.parent / "shared" / "bench" / "prompts.jsonl"))
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--requests", type=int, default=32, help="requests per level and model")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prepack", action=argparse.BooleanOptionalAction, default=None, help="default: the runtime's")
    ap.add_argument("--k", default="auto", help="the speculative model's k: auto (the repository default) or one "
                                                "of the engine's k values")
    ap.add_argument("--out", default="bench-results")
    a = ap.parse_args()
    rows = [json.loads(line)["prompt"] for line in Path(a.prompts).read_text().splitlines() if line.strip()]
    prompts = [rows[i % len(rows)] for i in range(a.requests)]
    repo = Path(tempfile.mkdtemp(prefix="specexport-bench-repo-"))
    for name, spec in (("speculative", True), ("target_only", False)):
        write_repository(a.engine, str(repo), name=name, threads=a.threads, speculative=spec, prepack=a.prepack,
                         k=a.k if a.k == "auto" else int(a.k))
    server = start_server(str(repo))
    levels = [int(c) for c in a.clients.split(",")]
    report = {"args": vars(a), "levels": []}
    try:
        server.wait_ready(600)
        for model in ("speculative", "target_only"):  # warm-up, excluded
            run_level(server.grpc_url, model, prompts[:2], 2, 8)
        for clients in levels:
            level = {}
            for model in ("speculative", "target_only"):
                level[model] = run_level(server.grpc_url, model, prompts, clients, a.max_tokens)
                print(json.dumps({model: {k: (round(v, 3) if isinstance(v, float) else v)
                                          for k, v in level[model].items() if k != "token_ids"}}), flush=True)
            same = level["speculative"]["token_ids"] == level["target_only"]["token_ids"] \
                if clients == 1 else None
            report["levels"].append({"clients": clients, **level, "identical_at_1_client": same})
    finally:
        server.stop()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for lv in report["levels"]:
        for m in ("speculative", "target_only"):
            lv[m].pop("token_ids")
    (out / "triton-bench.json").write_text(json.dumps(report, indent=1))
    lines = [f"specexport on tritonserver (loopback, gRPC streaming), {a.requests} chat requests per level, "
             f"max_tokens={a.max_tokens}, greedy, prepack={a.prepack}",
             "", "| clients | model | tokens/s | TTFT p50 / p95 (s) | latency p50 / p95 (s) | acceptance | errors |",
             "|---|---|---|---|---|---|---|"]
    for lv in report["levels"]:
        for m in ("speculative", "target_only"):
            r = lv[m]
            lines.append(f"| {lv['clients']} | {m} | {r['tokens_per_s']:.1f} | {r['ttft_p50_s']:.2f} / "
                         f"{r['ttft_p95_s']:.2f} | {r['latency_p50_s']:.2f} / {r['latency_p95_s']:.2f} | "
                         f"{r['acceptance_rate']:.2f} | {len(r['errors'])} |")
        lines.append(f"| {lv['clients']} | speculative / target-only | "
                     f"{lv['speculative']['tokens_per_s'] / lv['target_only']['tokens_per_s']:.2f}x | | | | |")
    (out / "triton-bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
