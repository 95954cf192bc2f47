"""Command line: `specexport build | generate | inspect | triton | serve`.

Defaults come from the dataclasses in config.py. User errors print one line and exit 2, no traceback.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import fields
from pathlib import Path

from .config import (ACTIVATIONS, BACKENDS, FORMATS, HEAD_BITS, OPS, PROMPT_LOOKUP, SMOOTH_ALPHA, TARGET_HEADS,
                     BuildConfig, DecoderConfig, SamplingParams)
from .errors import SpecExportError
from .export.bench_engines import BENCH_DRAFTS, BENCH_KS, VERSUS_ENGINES, bench_engine, versus_engine


def _defaults(cls) -> dict:
    return {f.name: f.default for f in fields(cls)}


def _add_shape_args(p: argparse.ArgumentParser) -> None:
    """Shape options default to None here and to DecoderConfig's defaults when used (one source of defaults)."""
    d = _defaults(DecoderConfig)
    p.add_argument("--max-seq-len", type=int, help=f"prompt + generated tokens per row (default {d['max_seq_len']})")
    p.add_argument("--max-batch", type=int, help=f"default {d['max_batch']}")
    p.add_argument("--prefill-chunk", type=int, help=f"C, prompt tokens per prefill pass (default {d['prefill_chunk']})")
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"],
                   help=f"default {d['dtype']}; build without --dtype keeps a GGUF's quantized weights as stored "
                        "(fp32 activations elsewhere), with it every weight is dequantized to that dtype")


def _shape_options(a) -> dict:
    return {k: v for k, v in (("max_seq_len", a.max_seq_len), ("max_batch", a.max_batch),
                              ("prefill_chunk", a.prefill_chunk), ("dtype", a.dtype)) if v is not None}


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    s = _defaults(SamplingParams)
    p.add_argument("--temperature", type=float, default=s["temperature"], help="0 is greedy")
    p.add_argument("--top-k", type=int, default=s["top_k"])
    p.add_argument("--top-p", type=float, default=s["top_p"])
    p.add_argument("--seed", type=int, default=s["seed"])


def _decoder(a):
    from .runtime import SpeculativeDecoder
    if a.engine:
        if a.target is not None or a.draft is not None or _shape_options(a):
            raise SpecExportError("an engine folder fixes the models and shapes: drop --target/--draft/--max-seq-len/"
                                  "--max-batch/--prefill-chunk/--dtype, or drop ENGINE_DIR to run checkpoints")
        opts = {"prepack": a.prepack} if a.prepack is not None else {}
        if a.drafter:
            opts["drafter"] = a.drafter
        return SpeculativeDecoder.load(a.engine, backend=a.backend or "onnxruntime", threads=a.threads, **opts)
    if a.prepack is not None or a.drafter:
        raise SpecExportError("--prepack and --drafter apply to engine folders: pass an ENGINE_DIR, or drop them")
    if a.backend not in (None, "torch"):
        raise SpecExportError(f"--backend {a.backend} runs engine folders: build one with specexport build and pass "
                              "it as ENGINE_DIR")
    opts = _shape_options(a)
    if a.k is not None:
        opts["k"] = a.k
    return SpeculativeDecoder.from_pretrained(a.target, a.draft, threads=a.threads, **opts)


def _stats_line(st) -> str:
    return (f"{st.new_tokens} tokens, {st.tokens_per_s:.1f} tok/s | steps {st.steps} | drafted {st.drafted} | "
            f"accepted {st.accepted} ({st.acceptance_rate:.0%}) | {st.mean_committed_per_step:.2f} tokens/step | "
            f"accept histogram {st.accept_hist} | "
            + (f"steps per k {dict(sorted(st.k_steps.items()))} | " if st.k == "auto" else "")
            + (" | ".join(f"{d} drafted {st.drafted_by[d]} accepted {st.accepted_by.get(d, 0)}"
                          for d in sorted(st.drafted_by)) + " | " if len(st.drafted_by) > 1 else "")
            + f"draft {st.draft_s:.2f}s verify {st.verify_s:.2f}s host {st.host_s:.2f}s prefill {st.prefill_s:.2f}s")


def cmd_generate(a) -> int:
    sp = SamplingParams(a.temperature, a.top_k, a.top_p, a.seed)
    if not a.prompt:
        raise SpecExportError("--prompt is empty: pass the text to continue")
    if a.compare is not None and a.compare < 1:
        raise SpecExportError(f"--compare takes a number of rounds >= 1 (or none: 3); got {a.compare}")
    t0 = time.perf_counter()
    dec = _decoder(a)
    load_s = time.perf_counter() - t0
    kw = dict(max_new_tokens=a.max_new_tokens, sampling=sp, chat=a.chat, k=a.k)
    if a.compare:  # warm-up of both modes, excluded from the figures
        for speculative in (True, False):
            dec.generate(a.prompt, speculative=speculative, **{**kw, "max_new_tokens": min(8, a.max_new_tokens)})
    ids, text, stats = [], "", None
    if a.stream and not a.json:
        for ev in dec.stream(a.prompt, **kw):
            print(ev.text, end="", flush=True)
            ids, text, stats = ids + ev.token_ids, text + ev.text, ev.stats or stats
        print(flush=True)
    else:
        out = dec.generate(a.prompt, **kw)[0]
        ids, text, stats = out.token_ids, out.text, out.stats
        if not a.json:
            print(text)
    result = {"text": text, "token_ids": ids, "stats": stats.as_dict(), "load_s": load_s}
    if a.compare:  # rounds of (speculative, target-only) on the same prompt, the shown run the first round's
        result.update(_compare_rounds(dec, a, kw, ids, stats, sp.greedy))
    if a.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"[{_stats_line(stats)}]", file=sys.stderr)
    if a.compare:
        same = {True: "identical", False: "DIFFERENT", None: "sampled"}[result["identical_to_target_only"]]
        r = result["speedup_per_round"]
        spread = f" (median of {len(r)} alternating rounds, {min(r):.2f}-{max(r):.2f})" if len(r) > 1 else ""
        print(f"[speculative {result['speculative_tokens_per_s']:.1f} tok/s vs target-only "
              f"{result['target_only_tokens_per_s']:.1f} tok/s: {result['speedup']:.2f}x speedup{spread}; "
              f"tokens {same}]", file=sys.stderr)
    return 0


def _compare_rounds(dec, a, kw: dict, ids: list[int], stats, greedy: bool) -> dict:
    """--compare N: N rounds of a speculative run then a target-only run (without --stream the first round's
    speculative run is the one shown; a streamed run, which prints as it goes, is not timed), each round's ratio
    of decode rates, and their median: one pair of runs on a noisy 2-core machine moves by 20-40% (stop 44:
    1.39x-1.94x on the README's prompt)."""
    spec, base, same = [] if a.stream else [stats.tokens_per_s], [], True
    for i in range(a.compare):
        if i or a.stream:
            again = dec.generate(a.prompt, **kw)[0]
            spec.append(again.stats.tokens_per_s)
            same = same and again.token_ids == ids
        out = dec.generate(a.prompt, speculative=False, **{**kw, "k": None})[0]
        base.append(out.stats.tokens_per_s)
        same = same and out.token_ids == ids
    ratios = [s / b for s, b in zip(spec, base)]
    return dict(target_only_tokens_per_s=statistics.median(base), speculative_tokens_per_s=statistics.median(spec),
                speedup=statistics.median(ratios), speedup_per_round=ratios,
                identical_to_target_only=same if greedy else None)


def _parse_ks(values: list[str] | None) -> tuple[int, ...]:
    if not values:
        return BuildConfig.ks
    try:
        return tuple(sorted({int(k) for v in values for k in v.split(",") if k.strip()}))
    except ValueError:
        raise SpecExportError(f"--k takes integers, e.g. --k 4 or --k 2,4,8; got {' '.join(values)}") from None


def cmd_build(a) -> int:
    from .export.build import build
    formats = tuple(f.strip() for f in a.format.split(",") if f.strip())
    cfg = BuildConfig(target=a.target, draft=a.draft, ks=_parse_ks(a.k), formats=formats,
                      sampling=not a.greedy_only, out=a.out, ops=a.ops, target_quant=a.target_quant,
                      activations=a.activations, target_head=a.target_head, **_shape_options(a))
    summary = build(cfg, progress=not a.json)
    if a.triton_repo:
        from .triton.repository import write_repository
        summary["triton"] = write_repository(summary["out"], a.triton_repo)
    if a.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"engine written to {summary['out']} ({summary['graphs']} graphs, {summary['total_bytes'] / 1e6:.1f} MB)")
    return 0


def cmd_triton(a) -> int:
    from .triton.repository import write_repository
    python_path = None
    if a.python_path is not None:
        try:
            python_path = json.loads(a.python_path) if a.python_path.strip().startswith("[") else \
                [x for x in a.python_path.split(":") if x]
        except json.JSONDecodeError:
            raise SpecExportError(f"--python-path takes a JSON list or colon-separated folders, got {a.python_path!r}") \
                from None
    out = write_repository(a.engine, a.repo, name=a.name, instances=a.instances, max_batch=a.max_batch,
                           backend=a.backend, threads=a.threads, speculative=not a.target_only, k=a.k,
                           prepack=a.prepack, python_path=python_path, standalone=a.standalone)
    print(json.dumps(out, indent=2) if a.json else f"model repository written to {out['repo']}: {', '.join(out['models'])}")
    return 0


def cmd_serve(a) -> int:
    from .triton.server import start_server
    server = start_server(a.repo, a.http_port, a.grpc_port, a.metrics_port, log_path=a.log)
    try:
        server.wait_ready(a.ready_timeout)
        print(f"tritonserver ready: http {server.http_url}, grpc {server.grpc_url}, metrics "
              f"127.0.0.1:{server.metrics_port} (log: {server.log_path}); Ctrl-C stops it", flush=True)
        server.process.wait()
    finally:
        server.stop()
    return 0


def cmd_openai(a) -> int:
    from .serve.openai_server import serve
    if not 0 <= a.port < 65536:
        raise SpecExportError(f"--port must be in [0, 65536), got {a.port}")
    if a.max_waiting < 1:
        raise SpecExportError(f"--max-waiting must be >= 1, got {a.max_waiting}")
    serve(a.engine, host=a.host, port=a.port, k=a.k, max_batch=a.max_batch, api_key=a.api_key, threads=a.threads,
          prepack=a.prepack, max_waiting=a.max_waiting, model_name=a.served_model_name,
          speculative=not a.target_only)
    return 0


DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "bench" / "prompts.jsonl"
def cmd_versus(a, prompts: str, ks: tuple[int, ...]) -> int:
    from .bench.versus import VersusConfig, check_peers, run_versus, write_versus
    from .models.loading import default_model_path
    peers = check_peers(tuple(x for x in a.peers.split(",") if x))
    try:
        lookup = tuple(int(x) for x in a.lookup.split(",") if x)
    except ValueError:
        raise SpecExportError(f"--lookup takes draft lengths, e.g. 4 or 4,10; got {a.lookup!r}") from None
    engines = {label: versus_engine(label, ks, Path(a.engines_dir)) for label in VERSUS_ENGINES}
    cfg = VersusConfig(prompts=prompts, engines=engines, gguf=default_model_path(), peers=peers, lookup=lookup,
                       max_new_tokens=a.max_new_tokens, per_category=a.per_category, reps=a.reps,
                       threads=a.threads or 2, hf=a.hf != "none")
    result = run_versus(cfg, log=lambda s: print(s, file=sys.stderr))
    rep = write_versus(result, a.out)
    print(rep["markdown"])
    print("written: " + ", ".join(rep["files"]), file=sys.stderr)
    return 0


def cmd_load(a, prompts: str) -> int:
    from .bench.load import LoadConfig, run_load, write_load
    try:
        clients = tuple(int(x) for x in a.clients.split(",") if x)
        ks = tuple(x if x == "auto" else int(x) for x in (a.load_k or "auto,4").split(",") if x)
    except ValueError:
        raise SpecExportError(f"--clients takes client counts (e.g. 1,4,16) and --load-k k values or auto (e.g. "
                              f"auto,4); got {a.clients!r} and {a.load_k!r}") from None
    if not clients or min(clients) < 1:
        raise SpecExportError(f"--clients takes client counts >= 1, e.g. 1,4,16; got {a.clients!r}")
    if a.requests is not None and a.requests < 1:
        raise SpecExportError(f"--requests takes a count >= 1 (requests per level and mode); got {a.requests}")
    # a level's tail (fewer requests left than clients) weighs on its rate: with 32 requests for 16 clients the A/A
    # control read 0.95x and 1.11x in two runs, with 96 1.04x (README, "Benchmark")
    requests = a.requests or max(32, 6 * max(clients))
    if not a.engine or len(a.engine) != 1:
        raise SpecExportError("--clients measures one engine: pass --engine DIR (built with --max-batch >= the "
                              "largest client count)")
    cfg = LoadConfig(prompts=prompts, engine=a.engine[0], clients=clients, requests=requests,
                     max_new_tokens=a.max_new_tokens, ks=ks, reps=a.reps, prepack=not a.no_prepack, threads=a.threads)
    write_load(run_load(cfg, log=lambda s: print(s, file=sys.stderr)), a.out)
    return 0


def cmd_bench(a) -> int:
    from .bench.report import write_report
    from .bench.runner import BenchConfig, run_bench
    prompts = a.prompts or str(DEFAULT_PROMPTS)
    if not Path(prompts).is_file():
        raise SpecExportError(f"prompt file {prompts} does not exist: pass --prompts FILE.jsonl")
    ks = _parse_ks(a.k) if a.k else BENCH_KS
    if a.peers:
        return cmd_versus(a, prompts, ks)
    if a.clients:
        return cmd_load(a, prompts)
    engines = a.engine or [bench_engine(d, ks, Path(a.engines_dir), True)
                           for d in (x for x in a.drafts.split(",") if x)]
    hf = () if a.hf == "none" else tuple(x for x in a.hf.split(",") if x)
    unknown = set(hf) - {"generate", "prompt_lookup", "assistant_int8"}
    if unknown:
        raise SpecExportError(f"--hf {a.hf!r}: choose from generate, prompt_lookup, assistant_int8 (or none)")
    cfg = BenchConfig(prompts=prompts, engines=engines, max_new_tokens=a.max_new_tokens, per_category=a.per_category,
                      auto=not a.no_auto, hf=hf, prepack=not a.no_prepack, threads=a.threads, reps=a.reps,
                      backends=_bench_backends(a.backends))
    result = run_bench(cfg, log=lambda s: print(s, file=sys.stderr))
    rep = write_report(result, a.out)
    print(rep["markdown"])
    print("written: " + ", ".join(rep["files"]), file=sys.stderr)
    return 0


def _bench_backends(text: str | None) -> tuple[str, ...]:
    extra = tuple(b for b in (text or "").split(",") if b and b != "onnxruntime")
    bad = [b for b in extra if b not in BACKENDS]
    if bad:
        raise SpecExportError(f"--backends {text!r}: {bad[0]!r} is not a backend; choose from {', '.join(BACKENDS)}")
    return extra


def cmd_inspect(a) -> int:
    from .export.inspect import describe, format_description
    info = describe(a.engine)
    print(json.dumps(info, indent=2) if a.json else format_description(info))
    return 0


def _k_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--k takes an integer or auto, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specexport", description="Lossless speculative decoding.")
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile a target/draft pair into an engine folder")
    b.add_argument("--target", default=None, help="checkpoint dir or .gguf (default: SmolLM2-135M-Instruct)")
    b.add_argument("--draft", default=BuildConfig.draft,
                   help=f"draft checkpoint dir, .gguf, quant:int8|int4[:b<block>][:sym|:asym][:smooth<alpha>]"
                        f"[:head4|8|0] (the target's own layers quantized, smoothed at {SMOOTH_ALPHA} unless "
                        f":smooth0, the lm_head {HEAD_BITS}-bit with its top candidates rescored by the target's "
                        "own head unless :head0), "
                        f"layers:auto|<list>[:int8|:int4] (the "
                        f"target with fewer layers, e.g. layers:0-11,14) or {PROMPT_LOOKUP!r}; an engine with a "
                        f"draft model runs the hybrid ({PROMPT_LOOKUP}+<draft>: lookup where it matches) by default")
    b.add_argument("--k", action="append", help="draft tokens per step; repeat or comma-separate to build several "
                                                f"(default {BuildConfig.ks[0]})")
    _add_shape_args(b)
    b.add_argument("--format", default=",".join(BuildConfig.formats), help=f"comma-separated: {', '.join(FORMATS)}")
    b.add_argument("--target-quant", default=None, metavar="SPEC",
                   help="quantize the target's linear layers weight-only: int4|int8[:b<block>][:sym|:asym] "
                        "(MatMulNBits; ONNX only)")
    b.add_argument("--activations", choices=ACTIVATIONS, default=BuildConfig.activations,
                   help="quantized layers (GGUF weights as stored, --target-quant) compute with int8 activations "
                        "(fast; ONNX Runtime's kernel defines the target) or fp32 (matches transformers on the "
                        "dequantized weights)")
    b.add_argument("--ops", choices=OPS, default=BuildConfig.ops,
                   help="ONNX graph set: fused (ONNX Runtime's fused ops: GroupQueryAttention, SkipSimplified"
                        "LayerNormalization; fastest) or portable (standard ONNX ops, for other runtimes)")
    b.add_argument("--target-head", choices=TARGET_HEADS, default=BuildConfig.target_head,
                   help="the fused greedy graphs' argmax over an fp32 target's lm_head: certified (a coarse 8-bit "
                        "head, a proven error bound, the top candidates rescored exactly, the full head only where "
                        "unproven; the same tokens) or full (the whole head every step)")
    b.add_argument("--greedy-only", action="store_true", help="skip the sampling graphs")
    b.add_argument("--out", default=BuildConfig.out, help="the engine folder to write")
    b.add_argument("--json", action="store_true", help="print a machine-readable summary")
    b.add_argument("--triton-repo", help="also write a Triton model repository for the engine (as specexport triton)")
    b.set_defaults(func=cmd_build)

    g = sub.add_parser("generate", help="generate text for a prompt and print the stats")
    g.add_argument("engine", nargs="?", default=None, metavar="ENGINE_DIR",
                   help="an engine folder from specexport build (omit to run checkpoints eagerly)")
    g.add_argument("--target", default=None, help="checkpoint dir or .gguf (default: SmolLM2-135M-Instruct)")
    g.add_argument("--draft", default=None, help=f"draft checkpoint dir, .gguf, quant:int8|int4, layers:auto|<list>, "
                                                 f"{PROMPT_LOOKUP!r} (the default) or "
                                                 f"{PROMPT_LOOKUP}+<draft> (the hybrid)")
    g.add_argument("--drafter", choices=("prompt-lookup", "model", "hybrid"), default=None,
                   help="with an ENGINE_DIR built with a draft model: which drafter runs (default: hybrid)")
    g.add_argument("--backend", choices=BACKENDS,
                   help="with ENGINE_DIR: onnxruntime (default), torch, torchscript or pt2")
    g.add_argument("--k", type=_k_arg, default=None,
                   help="draft tokens per step (an engine: one of its built k), or auto (chosen per step from "
                        "measured costs and acceptance; may turn speculation off)")
    _add_shape_args(g)
    g.add_argument("--threads", type=int, default=None)
    g.add_argument("--prepack", action=argparse.BooleanOptionalAction, default=None,
                   help="onnxruntime CPU: pre-pack weights for faster passes (default: on where the sessions "
                        "share one packed copy through ONNX Runtime's C library)")
    _add_sampling_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="apply the target's chat template")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--stream", action="store_true", help="print tokens as each step commits them")
    g.add_argument("--json", action="store_true", help="print a machine-readable result")
    g.add_argument("--compare", type=int, nargs="?", const=3, default=None, metavar="ROUNDS",
                   help="also run target-only decoding and print the measured speedup: the median over ROUNDS "
                        "(default 3) alternating rounds of a speculative and a target-only run")
    g.set_defaults(func=cmd_generate)

    bn = sub.add_parser("bench", help="every decoding mode side by side on a prompt set: tables and plots")
    bn.add_argument("--prompts", default=None, help=f"JSONL with id, category, prompt (default: {DEFAULT_PROMPTS})")
    bn.add_argument("--engine", action="append", help="engine folders to compare (the same target and k values); "
                                                      "default: build one per --drafts entry under --engines-dir")
    bn.add_argument("--drafts", default=",".join(BENCH_DRAFTS), help="quantized drafters to build when no --engine "
                                                                     "is given (prompt lookup always runs)")
    bn.add_argument("--k", action="append", help=f"k values to build (default {','.join(map(str, BENCH_KS))})")
    bn.add_argument("--engines-dir", default="engines/bench")
    bn.add_argument("--per-category", type=int, default=0, help="first N prompts of each category (0: all)")
    bn.add_argument("--max-new-tokens", type=int, default=128)
    bn.add_argument("--hf", default="generate,prompt_lookup,assistant_int8",
                    help="transformers baselines: comma-separated generate, prompt_lookup, assistant_int8, or none")
    bn.add_argument("--no-auto", action="store_true", help="skip the k=auto rows")
    bn.add_argument("--peers", default=None,
                    help="compare with peers on the same GGUF instead: llama.cpp,ort-genai (the [peers] extra; a "
                         "missing peer prints one line and is skipped); builds se-fp32, se-gguf, se-int4, "
                         "se-gguf-fp32act")
    bn.add_argument("--lookup", default="4", help="--peers: the peers' lookup / n-gram draft lengths (e.g. 4,10)")
    bn.add_argument("--reps", type=int, default=1, help="runs of every mode per prompt (pooled; --clients: per level)")
    bn.add_argument("--clients", default=None, help="throughput under load instead: concurrent clients per level "
                                                    "(e.g. 1,4,16) over the continuous batcher, one --engine")
    bn.add_argument("--requests", type=int, help="--clients: requests per level and mode (default: 6 per client of "
                    "the largest level, at least 32)")
    bn.add_argument("--load-k", default=None, help="--clients: speculative modes besides target-only (default auto,4)")
    bn.add_argument("--no-prepack", action="store_true", help="onnxruntime without weight pre-packing")
    bn.add_argument("--backends", default=None, help="also time the first engine on these backends (e.g. pt2,torch: "
                                                     "target-only and prompt lookup at the largest k; the engine needs "
                                                     "their formats)")
    bn.add_argument("--threads", type=int, default=None)
    bn.add_argument("--out", default="bench-results")
    bn.set_defaults(func=cmd_bench)

    i = sub.add_parser("inspect", help="describe an engine folder: models, k values, shapes, sizes, memory")
    i.add_argument("engine", metavar="ENGINE_DIR")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_inspect)

    t = sub.add_parser("triton", help="write a Triton Inference Server model repository for an engine folder")
    t.add_argument("engine", metavar="ENGINE_DIR")
    t.add_argument("--repo", required=True, help="the model repository to write (the model's folder is replaced)")
    t.add_argument("--name", default="specexport", help="the model's name in the repository")
    t.add_argument("--instances", type=int, default=1, help="model instances (each with its own batch and caches)")
    t.add_argument("--max-batch", type=int, default=None, help="rows per instance (<= the engine's max_batch)")
    t.add_argument("--backend", choices=BACKENDS, default=None, help="default: onnxruntime when the engine has ONNX")
    t.add_argument("--threads", type=int, default=None)
    t.add_argument("--k", type=_k_arg, default=None,
                   help="one of the engine's k values, or auto (the default: chosen per step from measured costs "
                        "and acceptance)")
    t.add_argument("--target-only", action="store_true", help="serve without speculation (for comparisons)")
    t.add_argument("--prepack", action=argparse.BooleanOptionalAction, default=None,
                   help="onnxruntime weight pre-packing (see generate --prepack)")
    t.add_argument("--standalone", action="store_true",
                   help="also add each ONNX step graph as its own onnxruntime model (needs a Triton with that backend)")
    t.add_argument("--python-path", default=None,
                   help="folders the model adds to sys.path (JSON list or colon-separated; default: where this "
                        "interpreter finds specexport and its dependencies; '[]' inside a container)")
    t.add_argument("--json", action="store_true")
    t.set_defaults(func=cmd_triton)

    o = sub.add_parser("openai", help="serve an engine folder over an OpenAI-compatible HTTP API (continuous batching)")
    o.add_argument("engine", metavar="ENGINE_DIR")
    o.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    o.add_argument("--port", type=int, default=8000)
    o.add_argument("--k", type=_k_arg, default="auto", help="one of the engine's k values, or auto (default)")
    o.add_argument("--max-batch", type=int, default=None, help="rows decoded together (<= the engine's max_batch)")
    o.add_argument("--max-waiting", type=int, default=64,
                   help="requests that may wait for a row; more get 429 with Retry-After")
    o.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $SPECEXPORT_API_KEY, else none)")
    o.add_argument("--served-model-name", default=None, help="the model id clients pass (default: the folder's name)")
    o.add_argument("--threads", type=int, default=None)
    o.add_argument("--prepack", action=argparse.BooleanOptionalAction, default=None,
                   help="onnxruntime weight pre-packing (see generate --prepack)")
    o.add_argument("--target-only", action="store_true", help="serve without speculation (for comparisons)")
    o.set_defaults(func=cmd_openai)

    v = sub.add_parser("serve", help="run the tritonserver from nvidia-pytriton over a repository on 127.0.0.1")
    v.add_argument("repo", metavar="REPO")
    v.add_argument("--http-port", type=int, default=8000)
    v.add_argument("--grpc-port", type=int, default=8001)
    v.add_argument("--metrics-port", type=int, default=8002)
    v.add_argument("--log", default=None, help="server log file (default: in its work folder)")
    v.add_argument("--ready-timeout", type=float, default=300.0)
    v.set_defaults(func=cmd_serve)
    return ap


# what `pip install 'specexport[build]'` adds: compiling engines and running checkpoints need these; running an
# engine folder with onnxruntime needs none of them
BUILD_EXTRA = ("torch", "transformers", "onnx", "gguf", "tqdm")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SpecExportError as e:
        print(f"specexport: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        missing = (e.name or "").split(".")[0]
        if missing not in BUILD_EXTRA:
            raise
        print(f"specexport: error: specexport {args.command} needs the build extra ({missing} is not installed): "
              "pip install 'specexport[build]'", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
