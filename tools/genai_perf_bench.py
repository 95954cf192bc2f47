#!/usr/bin/env python
"""genai-perf (NVIDIA's LLM benchmark CLI, driving the perf_analyzer C++ binary) against specexport's two servers.

For one engine folder:
  * OpenAI: `specexport openai ENGINE --k auto` and `specexport openai ENGINE --target-only`, each on a free port
    of 127.0.0.1; genai-perf `--service-kind openai --endpoint-type chat|completions --streaming`;
  * Triton: a repository with two models over the engine (`spec`: --k auto, `target`: --target-only), served by
    `specexport serve`; genai-perf `--service-kind triton --backend tensorrtllm --streaming` over gRPC (it sends
    text_input, max_tokens, stream);
and at each concurrency level (default 1, 4, 16) runs genai-perf on the speculative model, then the target-only
one (alternating per level; with --reps N, N times, the order swapped each repetition), with the same synthetic
prompts (same --random-seed), each run after one round of warm-up requests (--warmup). Reads each run's
profile_export_genai_perf.json and prints one table: output token throughput, p50 request latency, p50 time to
first token, p50 inter-token latency (geometric means over repetitions), and spec/target-only throughput ratio
(and each repetition's); writes everything as JSON (--out).

genai-perf lives in its own venv (see tools/install_genai_perf.sh: genai-perf 0.0.9 + perf_analyzer from the
tritonclient 2.51.0 wheel, the newest that loads with glibc 2.36):

    bash tools/install_genai_perf.sh /work/gp-venv
    .venv/bin/python tools/genai_perf_bench.py engines/load16 --prepack --out bench-results/genai_perf.json
    # smoke test: few requests, short outputs
    .venv/bin/python tools/genai_perf_bench.py engines/load16 --clients 1,4 --request-count 4 --max-tokens 32

Before the Triton runs it also sends each input of TensorRT-LLM's Triton models (exclude_input_in_output,
min_length, end_id, random_seed, stop_words, ...) once over gRPC and reports, in the log and the JSON
(triton_trtllm_inputs), which the model accepts and Triton's exact error for the others. genai-perf 0.0.13+
(no --service-kind; --endpoint-type kserve for Triton) is driven too: pass --genai-perf; from 0.0.14 on it always
sends exclude_input_in_output, which perf_analyzer refuses before sending anything while the model lacks it.
Extra genai-perf arguments go after `--` (they apply to every run).

The full run (1, 4, 16 clients, 32 requests each, 64 tokens) should take roughly 15 minutes (estimated from
the smoke runs, not measured) for SmolLM2-135M on 2 CPU cores; run it on a quiet machine.

Output lengths: genai-perf asks for max_tokens = --max-tokens; the OpenAI server is sent ignore_eos (every answer
runs to max_tokens), the Triton model may stop earlier at an end-of-sequence token, so the table also shows the mean output length genai-perf counted (its own
re-tokenization of the streamed text). Both servers decode greedily here (temperature 0 is sent to the
OpenAI server; the Triton model's default is 0), so speculative and target-only produce the same text.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from specexport.bench.report import geomean  # noqa: E402 (the checkout's package, installed or not)
VENV_BIN = Path(sys.executable).parent
VARIANTS = (("spec", ["--k", "auto"]), ("target", ["--target-only"]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Proc:
    """A server subprocess in its own process group (so its children, e.g. tritonserver, stop with it)."""

    def __init__(self, cmd: list[str], logfile: Path):
        self.cmd, self.logfile = cmd, logfile
        self.f = open(logfile, "wb")
        self.p = subprocess.Popen(cmd, stdout=self.f, stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self) -> bool:
        return self.p.poll() is None

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.logfile.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.alive():
            try:
                os.killpg(self.p.pid, signal.SIGINT)  # `specexport serve` stops tritonserver on Ctrl-C
                self.p.wait(timeout=30)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
        try:  # anything left in the group
            os.killpg(self.p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.p.wait()
        self.f.close()


def wait_http(url: str, proc: Proc, timeout: float) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if not proc.alive():
            raise RuntimeError(f"server exited ({proc.p.returncode}): {' '.join(proc.cmd)}\n{proc.tail()}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} not ready after {timeout:.0f}s\n{proc.tail()}")


def post_json(url: str, body: dict, timeout: float = 300) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def pick(stats: dict, metric: str, key: str):
    v = stats.get(metric)
    return v.get(key) if isinstance(v, dict) else None


def run_genai_perf(a, *, label: str, model: str, kind_args: list[str], clients: int, art: Path) -> dict:
    """One genai-perf profile run, run again (up to --retries times) when perf_analyzer leaves an empty or cut-off
    export (genai-perf 0.0.9's perf_analyzer does so now and then against the Triton model; it exits 0);
    returns the parsed summary (or the error), with how many tries it took."""
    for attempt in range(a.retries + 1):
        res = _run_genai_perf_once(a, label=label, model=model, kind_args=kind_args, clients=clients, art=art)
        res["attempts"] = attempt + 1
        if not res.get("error") or "Failed to parse JSON" not in res["error"]:
            return res
        log(f"  {label} x{clients}: perf_analyzer's export is empty or cut off; running it again")
    return res


def _run_genai_perf_once(a, *, label: str, model: str, kind_args: list[str], clients: int, art: Path) -> dict:
    if art.exists():
        shutil.rmtree(art)
    art.mkdir(parents=True)
    requests = max(a.request_count, clients) if a.request_count else None
    cmd = [a.genai_perf, "profile", "-m", model, *kind_args, "--streaming",
           "--tokenizer", a.tokenizer,
           "--synthetic-input-tokens-mean", str(a.input_tokens), "--synthetic-input-tokens-stddev",
           str(a.input_tokens_stddev), "--output-tokens-mean", str(a.max_tokens), "--output-tokens-stddev", "0",
           "--num-dataset-entries", str(a.num_prompts), "--random-seed", str(a.seed),
           "--concurrency", str(clients), "--artifact-dir", str(art), "--profile-export-file", "profile_export.json"]
    if a.warmup is None or a.warmup > 0:  # default: one round (as many requests as clients), as `bench --clients`
        cmd += ["--warmup-request-count", str(clients if a.warmup is None else a.warmup)]
    if requests:
        cmd += ["--request-count", str(requests)]
    else:
        cmd += ["--measurement-interval", str(a.measurement_interval_ms)]
    cmd += a.extra_genai_perf
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", COLUMNS="4000")  # no rich wrapping
    env["PATH"] = os.pathsep.join([str(Path(a.genai_perf).resolve().parent), env.get("PATH", "")])
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.run_timeout, cwd=art)
        out, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        out += f"\n(genai-perf killed after {a.run_timeout}s)"
        rc = -1
    wall = time.time() - t0
    (art / "genai_perf.log").write_text(" ".join(cmd) + "\n\n" + out)
    pa_cmd = next((ln.split("Running Perf Analyzer :", 1)[1].strip().strip("'\"")
                   for ln in out.splitlines() if "Running Perf Analyzer :" in ln), None) or \
        next((ln[ln.index("'perf_analyzer ") + 1:].split("'")[0] for ln in out.splitlines()
              if "'perf_analyzer " in ln), None)
    res = {"server": label.split("/")[0], "variant": label.split("/")[1], "model": model, "clients": clients,
           "requests": requests, "genai_perf_cmd": cmd, "perf_analyzer_cmd": pa_cmd, "wall_s": round(wall, 1),
           "artifact_dir": str(art)}
    # genai-perf <= 0.0.12 writes into --artifact-dir, newer ones into a subfolder named after the run
    export = next(iter(sorted(art.rglob("profile_export_genai_perf.json"))), art / "profile_export_genai_perf.json")
    if rc != 0 or not export.exists():
        lines = [ln for ln in out.splitlines() if ln.strip()]
        # perf_analyzer's own message ("error: Failed to init manager inputs: ...") first, then genai-perf's
        pa = [ln.strip() for ln in lines if ln.lstrip().lower().startswith(("error:", "thread ["))]
        errs = [ln for ln in lines if "rror" in ln or "failed" in ln.lower()]
        res["error"] = "\n".join(pa[:3] + [e for e in errs[-4:] if e.strip() not in pa]) or \
            "\n".join(lines[-8:]) or f"genai-perf exited {rc}"
        res["rc"] = rc
        return res
    stats = json.loads(export.read_text())
    res.update({
        "output_tok_per_s": pick(stats, "output_token_throughput", "avg"),
        "request_per_s": pick(stats, "request_throughput", "avg"),
        "request_latency_p50_ms": pick(stats, "request_latency", "p50"),
        "request_latency_p95_ms": pick(stats, "request_latency", "p95"),
        "ttft_p50_ms": pick(stats, "time_to_first_token", "p50"),
        "ttft_p95_ms": pick(stats, "time_to_first_token", "p95"),
        "itl_p50_ms": pick(stats, "inter_token_latency", "p50"),
        "output_len_mean": pick(stats, "output_sequence_length", "avg"),
        "input_len_mean": pick(stats, "input_sequence_length", "avg"),
        "genai_perf_stats": {k: v for k, v in stats.items() if isinstance(v, dict) and "unit" in v},
    })
    return res


def run_levels(a, server: str, work: Path, kind_args) -> list[dict]:
    """genai-perf at each concurrency level, speculative then target-only (alternating per level).
    kind_args(variant name) -> the server-specific genai-perf arguments."""
    rows = []
    for clients in a.clients:
        for rep in range(a.reps):  # the order alternates per repetition: spec first, then target-only first
            for name, _ in (VARIANTS if rep % 2 == 0 else VARIANTS[::-1]):
                log(f"genai-perf {server}/{name} x{clients} (repetition {rep + 1}/{a.reps})")
                rows.append(run_genai_perf(a, label=f"{server}/{name}", model=name, kind_args=kind_args(name),
                                           clients=clients, art=work / f"{server}-{name}-c{clients}-r{rep + 1}"))
                rows[-1]["rep"] = rep + 1
                report_row(rows[-1])
    return rows


def openai_phase(a, engine: Path, work: Path) -> list[dict]:
    procs, ports = {}, {}
    try:
        for name, flags in VARIANTS:
            ports[name] = free_port()
            cmd = [a.specexport, "openai", str(engine), "--port", str(ports[name]), "--served-model-name", name,
                   *flags, *a.server_args]
            if a.max_batch:
                cmd += ["--max-batch", str(a.max_batch)]
            log(f"openai/{name}: {' '.join(cmd)}")
            procs[name] = Proc(cmd, work / f"openai-{name}.log")
        for name, p in procs.items():
            wait_http(f"http://127.0.0.1:{ports[name]}/health", p, a.ready_timeout)
            ep = "chat/completions" if a.endpoint_type == "chat" else "completions"
            body = {"model": name, "max_tokens": 8, "temperature": 0}
            body.update({"messages": [{"role": "user", "content": "Hello"}]} if a.endpoint_type == "chat"
                        else {"prompt": "Hello"})
            post_json(f"http://127.0.0.1:{ports[name]}/v1/{ep}", body)  # warm-up
            log(f"openai/{name} ready on port {ports[name]}")
        return run_levels(a, "openai", work, lambda name: (["--service-kind", "openai"] if a.old_cli else []) + [
            "--endpoint-type", a.endpoint_type, "--url", f"127.0.0.1:{ports[name]}",
            "--extra-inputs", "temperature:0", "--extra-inputs", "ignore_eos:true"])
    finally:
        for p in procs.values():
            p.stop()


# Inputs of TensorRT-LLM's Triton models (ensemble / tensorrt_llm_bls) that clients written for them send, with
# their TRT-LLM types: newer genai-perf (0.0.10+) always sends exclude_input_in_output, and min_length with
# --output-tokens-mean-deterministic; others come from --extra-inputs or from hand-written clients.
TRTLLM_INPUTS = {
    "exclude_input_in_output": ("BOOL", True), "min_length": ("INT32", 4), "end_id": ("INT32", 2),
    "pad_id": ("INT32", 2), "random_seed": ("UINT64", 0), "stop_words": ("BYTES", b"\n\n"),
    "bad_words": ("BYTES", b"zzzz"), "beam_width": ("INT32", 1), "return_log_probs": ("BOOL", False),
    "repetition_penalty": ("FP32", 1.0), "presence_penalty": ("FP32", 0.0), "frequency_penalty": ("FP32", 0.0),
    "length_penalty": ("FP32", 1.0), "num_return_sequences": ("INT32", 1),
    "temperature": ("FP32", 0.0), "top_k": ("INT32", 1), "top_p": ("FP32", 1.0),
}


def probe_trtllm_inputs(url: str, model: str) -> dict:
    """Send each TRT-LLM input once (next to text_input/max_tokens/stream): accepted, or Triton's exact error."""
    import numpy as np

    from specexport.triton.client import generate
    np_types = {"BOOL": np.bool_, "INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32, "BYTES": np.object_}
    out = {}
    for name, (dtype, value) in TRTLLM_INPUTS.items():
        r = generate(url, model, "Hello", max_tokens=4, stream=True,
                     **{name: (np.array([value], dtype=np_types[dtype]), dtype)})
        out[name] = {"type": dtype, "accepted": r.error is None, "error": r.error}
    return out


def triton_phase(a, engine: Path, work: Path) -> list[dict]:
    repo = work / "triton-repo"
    for name, flags in VARIANTS:
        cmd = [a.specexport, "triton", str(engine), "--repo", str(repo), "--name", name, *flags, *a.server_args]
        if a.max_batch:
            cmd += ["--max-batch", str(a.max_batch)]
        log(f"triton/{name}: {' '.join(cmd)}")
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    http, grpc, metrics = free_port(), free_port(), free_port()
    cmd = [a.specexport, "serve", str(repo), "--http-port", str(http), "--grpc-port", str(grpc),
           "--metrics-port", str(metrics), "--log", str(work / "tritonserver.log"),
           "--ready-timeout", str(a.ready_timeout)]
    log(" ".join(cmd))
    server = Proc(cmd, work / "specexport-serve.log")
    try:
        for name, _ in VARIANTS:
            wait_http(f"http://127.0.0.1:{http}/v2/models/{name}/ready", server, a.ready_timeout)
        from specexport.triton.client import generate  # warm-up over gRPC (needs tritonclient: the main venv)
        for name, _ in VARIANTS:
            r = generate(f"127.0.0.1:{grpc}", name, "Hello", max_tokens=8, stream=True)
            if r.error:
                raise RuntimeError(f"warm-up of {name} failed: {r.error}")
        log(f"triton ready: grpc 127.0.0.1:{grpc}")
        a.trtllm_probe = probe_trtllm_inputs(f"127.0.0.1:{grpc}", VARIANTS[0][0])
        refused = {k: v["error"] for k, v in a.trtllm_probe.items() if not v["accepted"]}
        log(f"TensorRT-LLM inputs accepted: {', '.join(k for k, v in a.trtllm_probe.items() if v['accepted'])}")
        for k, e in refused.items():
            log(f"  refused {k}: {e}")
        return run_levels(a, "triton", work, lambda name: (
            ["--service-kind", "triton"] if a.old_cli else ["--endpoint-type", "kserve"]) + [
            "--backend", "tensorrtllm", "--url", f"127.0.0.1:{grpc}"])
    finally:
        server.stop()


def fmt(v, spec="{:.1f}"):
    return "-" if v is None else spec.format(v)


def report_row(r: dict) -> None:
    if "error" in r:
        log(f"  {r['server']}/{r['variant']} x{r['clients']}: ERROR\n    " + r["error"].replace("\n", "\n    "))
    else:
        log(f"  {r['server']}/{r['variant']} x{r['clients']}: {fmt(r['output_tok_per_s'])} tok/s, "
            f"latency p50 {fmt(r['request_latency_p50_ms'], '{:.0f}')} ms, ttft p50 {fmt(r['ttft_p50_ms'], '{:.0f}')}"
            f" ms, itl p50 {fmt(r['itl_p50_ms'])} ms, output {fmt(r['output_len_mean'])} tokens ({r['wall_s']} s)")


def _ok(r: dict | None) -> bool:
    return r is not None and not r.get("error") and bool(r.get("output_tok_per_s"))


def merge_reps(rs: list[dict]) -> dict | None:
    """One variant's repetitions at one level -> one row: the geometric mean of each figure over the runs that
    worked (a run that failed is counted in "failed"); every run failed: the first failure."""
    good = [r for r in rs if _ok(r)]
    if not good:
        return rs[0] if rs else None
    out = dict(good[0])
    for key in ("output_tok_per_s", "request_latency_p50_ms", "ttft_p50_ms", "itl_p50_ms", "output_len_mean"):
        vals = [r[key] for r in good if r.get(key)]
        out[key] = geomean(vals) if vals else None
    out["failed"] = len(rs) - len(good)
    return out


def table(rows: list[dict]) -> tuple[str, list[dict]]:
    """Per level: each variant's figures (geometric means over the repetitions that worked), spec / target-only
    throughput, and with repetitions, the ratio within each repetition where both runs worked. genai-perf 0.0.9's
    perf_analyzer now and then writes an empty or cut-off export against the Triton model (4 of 50 runs here; it is
    run again, --retries); a run that still failed is reported, not counted."""
    by: dict = {}
    for r in rows:
        by.setdefault((r["server"], r["clients"], r["variant"]), []).append(r)
    head = ("| server | clients | variant | output tok/s | req latency p50 ms | TTFT p50 ms | ITL p50 ms "
            "| output tokens (mean) | spec/target tok/s |")
    lines = [head, "|" + "|".join("---" for _ in range(9)) + "|"]
    ratios = []
    for server, clients in sorted({(r["server"], r["clients"]) for r in rows}, key=lambda x: (x[0], x[1])):
        runs = {v: by.get((server, clients, v), []) for v in ("spec", "target")}
        s, t = merge_reps(runs["spec"]), merge_reps(runs["target"])
        ratio = s["output_tok_per_s"] / t["output_tok_per_s"] if _ok(s) and _ok(t) else None
        pairs = {}
        for v, rs in runs.items():
            for r in rs:
                pairs.setdefault(r.get("rep", 1), {})[v] = r
        per_rep = [p["spec"]["output_tok_per_s"] / p["target"]["output_tok_per_s"] for _, p in sorted(pairs.items())
                   if _ok(p.get("spec")) and _ok(p.get("target"))]
        failed = sum(1 for rs in runs.values() for r in rs if not _ok(r))
        ratios.append({"server": server, "clients": clients, "spec_over_target_tok_per_s": ratio,
                       "per_repetition": per_rep, "failed_runs": failed})
        for v, r in (("spec", s), ("target-only", t)):
            if r is None:
                continue
            if not _ok(r):
                error = (r.get("error") or "no output").splitlines()[0][:100]
                lines.append(f"| {server} | {clients} | {v} | error: {error} | | | | | |")
                continue
            note = ""
            if v == "spec" and (len(per_rep) > 1 or failed):
                failures = f"; {failed} run(s) failed" if failed else ""
                note = " (" + ", ".join(f"{x:.2f}" for x in per_rep) + failures + ")"
            lines.append(f"| {server} | {clients} | {v} | {fmt(r['output_tok_per_s'])} | "
                         f"{fmt(r['request_latency_p50_ms'], '{:.0f}')} | {fmt(r['ttft_p50_ms'], '{:.0f}')} | "
                         f"{fmt(r['itl_p50_ms'])} | {fmt(r['output_len_mean'])} | "
                         f"{fmt(ratio, '{:.2f}x') if v == 'spec' else ''}{note} |")
    return "\n".join(lines), ratios


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 usage="%(prog)s ENGINE [options] [-- extra genai-perf arguments]")
    ap.add_argument("engine", help="engine folder (max_batch >= the largest --clients for a fair batch)")
    ap.add_argument("--genai-perf", default="/work/gp-venv/bin/genai-perf",
                    help="genai-perf executable; perf_analyzer is looked up next to it first")
    ap.add_argument("--specexport", default=str(VENV_BIN / "specexport"))
    ap.add_argument("--servers", default="openai,triton", help="comma list: openai, triton")
    ap.add_argument("--clients", default="1,4,16", help="concurrency levels")
    ap.add_argument("--warmup", type=int, default=None,
                    help="warm-up requests before each measured run, not counted (default: one per client; 0: none). "
                         "A server meets each batch size once: auto measures its costs there, e.g. the first "
                         "16-client run of a fresh server gave 0.79x against 0.99x and 1.01x after it")
    ap.add_argument("--retries", type=int, default=1, help="runs again when perf_analyzer's export is empty or cut off")
    ap.add_argument("--reps", type=int, default=1, help="repetitions of each level (the variants' order alternates; "
                    "the table gives geometric means and each repetition's ratio)")
    ap.add_argument("--request-count", type=int, default=32,
                    help="requests per level and model (at least the concurrency); 0: perf_analyzer's "
                         "measurement windows (--measurement-interval-ms) until stable")
    ap.add_argument("--measurement-interval-ms", type=int, default=20000)
    ap.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request (genai-perf "
                    "--output-tokens-mean, stddev 0)")
    ap.add_argument("--input-tokens", type=int, default=150, help="synthetic prompt length (tokens, mean)")
    ap.add_argument("--input-tokens-stddev", type=int, default=25)
    ap.add_argument("--num-prompts", type=int, default=100, help="distinct synthetic prompts genai-perf draws")
    ap.add_argument("--seed", type=int, default=0, help="genai-perf --random-seed (same prompts for both)")
    ap.add_argument("--endpoint-type", choices=["chat", "completions"], default="chat")
    ap.add_argument("--tokenizer", default=None, help="default: ENGINE/tokenizer")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prepack", action=argparse.BooleanOptionalAction, default=None, help="default: the runtime's")
    ap.add_argument("--max-batch", type=int, default=None)
    ap.add_argument("--ready-timeout", type=float, default=300)
    ap.add_argument("--run-timeout", type=float, default=900, help="seconds per genai-perf run")
    ap.add_argument("--work", default=None, help="artifacts, logs, repository (default: a fresh folder under "
                    "bench-results/genai-perf-<time>)")
    ap.add_argument("--out", default=None, help="JSON results (default: WORK/results.json)")
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    a = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    a.extra_genai_perf = extra  # after --: passed to every genai-perf run
    a.trtllm_probe = None
    # genai-perf <= 0.0.12 takes --service-kind openai|triton; 0.0.13+ infers it from --endpoint-type
    # (chat|completions: openai, kserve: triton)
    try:
        helptext = subprocess.run([a.genai_perf, "profile", "--help"], capture_output=True, text=True,
                                  timeout=120).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        sys.exit(f"{a.genai_perf}: {e} (run tools/install_genai_perf.sh)")
    a.old_cli = "--service-kind" in helptext
    v = subprocess.run([a.genai_perf, "--version"], capture_output=True, text=True, timeout=120)
    a.genai_perf_version = (v.stdout or v.stderr).strip().splitlines()[-1] if (v.stdout or v.stderr).strip() else None

    engine = Path(a.engine).resolve()
    manifest = json.loads((engine / "manifest.json").read_text())
    a.clients = [int(c) for c in a.clients.split(",") if c]
    a.tokenizer = a.tokenizer or str(engine / manifest.get("tokenizer", "tokenizer"))
    a.server_args = (["--threads", str(a.threads)] if a.threads else []) + (
        [] if a.prepack is None else ["--prepack" if a.prepack else "--no-prepack"])
    servers = [s for s in a.servers.split(",") if s]
    if max(a.clients) > manifest.get("max_batch", 1):
        log(f"note: engine max_batch {manifest.get('max_batch')} < {max(a.clients)} clients: requests queue")
    work = Path(a.work or ROOT / "bench-results" / f"genai-perf-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    work.mkdir(parents=True, exist_ok=True)
    log(f"engine {engine} (ks {manifest.get('ks')}, max_batch {manifest.get('max_batch')}); work folder {work}; "
        f"{a.genai_perf_version or a.genai_perf}")

    rows: list[dict] = []
    t0 = time.time()
    for server in servers:
        try:
            rows += {"openai": openai_phase, "triton": triton_phase}[server](a, engine, work)
        except Exception as e:  # noqa: BLE001 - report and go on with the other server
            log(f"{server}: {type(e).__name__}: {e}")
            rows.append({"server": server, "variant": "spec", "clients": 0, "error": f"{type(e).__name__}: {e}"})
    text, ratios = table([r for r in rows if r.get("clients")])
    print()
    print(text)
    for r in rows:
        if not r.get("clients"):
            print(f"{r['server']}: {r['error']}")
    result = {"engine": str(engine), "manifest": {k: manifest.get(k) for k in ("ks", "max_batch", "drafter", "dtype")},
              "settings": {"clients": a.clients, "reps": a.reps, "warmup": a.warmup, "request_count": a.request_count,
                           "max_tokens": a.max_tokens,
                           "input_tokens": a.input_tokens, "endpoint_type": a.endpoint_type, "threads": a.threads,
                           "prepack": a.prepack, "genai_perf": a.genai_perf,
                           "genai_perf_version": a.genai_perf_version},
              "wall_s": round(time.time() - t0, 1), "rows": rows,
              "triton_trtllm_inputs": a.trtllm_probe, "ratios": ratios, "table_markdown": text}
    out = Path(a.out) if a.out else work / "results.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    log(f"wrote {out} ({result['wall_s']} s)")
    return 1 if any(r.get("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
