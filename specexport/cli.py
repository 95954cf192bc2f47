"""Command line: `specexport generate` (and, as later work lands, build | bench | triton).

Defaults come from the dataclasses in config.py. User errors print one line and exit 2, no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import fields

from .config import PROMPT_LOOKUP, DecoderConfig, SamplingParams
from .errors import SpecExportError


def _defaults(cls) -> dict:
    return {f.name: f.default for f in fields(cls)}


def _add_decoder_args(p: argparse.ArgumentParser) -> None:
    d = _defaults(DecoderConfig)
    p.add_argument("--target", default=None, help="checkpoint dir or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--draft", default=PROMPT_LOOKUP, help=f"draft checkpoint dir, .gguf or {PROMPT_LOOKUP!r}")
    p.add_argument("--k", type=int, default=d["k"], help="draft tokens per step")
    p.add_argument("--max-seq-len", type=int, default=d["max_seq_len"])
    p.add_argument("--max-batch", type=int, default=d["max_batch"])
    p.add_argument("--prefill-chunk", type=int, default=d["prefill_chunk"])
    p.add_argument("--dtype", default=d["dtype"], choices=["fp32", "fp16", "bf16"])
    p.add_argument("--threads", type=int, default=d["threads"])


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    s = _defaults(SamplingParams)
    p.add_argument("--temperature", type=float, default=s["temperature"], help="0 is greedy")
    p.add_argument("--top-k", type=int, default=s["top_k"])
    p.add_argument("--top-p", type=float, default=s["top_p"])
    p.add_argument("--seed", type=int, default=s["seed"])


def _decoder(a):
    from .runtime import SpeculativeDecoder
    return SpeculativeDecoder.from_pretrained(a.target, a.draft, k=a.k, max_seq_len=a.max_seq_len,
                                              max_batch=a.max_batch, prefill_chunk=a.prefill_chunk, dtype=a.dtype,
                                              threads=a.threads)


def _stats_line(st) -> str:
    return (f"{st.new_tokens} tokens, {st.tokens_per_s:.1f} tok/s | steps {st.steps} | drafted {st.drafted} | "
            f"accepted {st.accepted} ({st.acceptance_rate:.0%}) | {st.mean_committed_per_step:.2f} tokens/step | "
            f"accept histogram {st.accept_hist} | draft {st.draft_s:.2f}s verify {st.verify_s:.2f}s "
            f"host {st.host_s:.2f}s prefill {st.prefill_s:.2f}s")


def cmd_generate(a) -> int:
    sp = SamplingParams(a.temperature, a.top_k, a.top_p, a.seed)
    if not a.prompt:
        raise SpecExportError("--prompt is empty: pass the text to continue")
    t0 = time.perf_counter()
    dec = _decoder(a)
    load_s = time.perf_counter() - t0
    kw = dict(max_new_tokens=a.max_new_tokens, sampling=sp, chat=a.chat)
    if a.compare:  # warm-up, excluded from the figures
        dec.generate(a.prompt, **{**kw, "max_new_tokens": min(8, a.max_new_tokens)})
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
    if a.compare:  # target-only on the same prompt, right after the speculative run
        base = dec.generate(a.prompt, speculative=False, **kw)[0]
        result.update(target_only_tokens_per_s=base.stats.tokens_per_s, speculative_tokens_per_s=stats.tokens_per_s,
                      speedup=stats.tokens_per_s / base.stats.tokens_per_s,
                      identical_to_target_only=ids == base.token_ids if sp.greedy else None)
    if a.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"[{_stats_line(stats)}]", file=sys.stderr)
    if a.compare:
        same = {True: "identical", False: "DIFFERENT", None: "sampled"}[result["identical_to_target_only"]]
        print(f"[speculative {result['speculative_tokens_per_s']:.1f} tok/s vs target-only "
              f"{result['target_only_tokens_per_s']:.1f} tok/s: {result['speedup']:.2f}x speedup; tokens {same}]",
              file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specexport", description="Lossless speculative decoding.")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for a prompt and print the stats")
    _add_decoder_args(g)
    _add_sampling_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="apply the target's chat template")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--stream", action="store_true", help="print tokens as each step commits them")
    g.add_argument("--json", action="store_true", help="print a machine-readable result")
    g.add_argument("--compare", action="store_true",
                   help="also run target-only decoding and print the measured speedup")
    g.set_defaults(func=cmd_generate)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SpecExportError as e:
        print(f"specexport: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
