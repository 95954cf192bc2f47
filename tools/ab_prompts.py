"""What the side-by-side tools (free_k1_ab.py, autok_ab.py, step_ab.py) share: their prompt and run options, the prompts
(every n-th of the bench's), the warm-up of every decoder before timing, and `--set FIELD=VALUE` (set_field)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "bench" / "prompts.jsonl"


def add_args(ap: argparse.ArgumentParser) -> None:
    """engine, --reps, --max-new-tokens, --prompts, --prompts-n, --no-prepack, --drafter."""
    ap.add_argument("engine")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts", default=str(PROMPTS))
    ap.add_argument("--prompts-n", type=int, default=0, help="this many of the prompts, evenly spaced (0: all)")
    ap.add_argument("--no-prepack", action="store_true")
    ap.add_argument("--drafter", choices=("hybrid", "model", "prompt-lookup"),
                    help="which drafter of an engine built with a draft model (default: the engine's default)")


def load_opts(a: argparse.Namespace) -> dict:
    """SpeculativeDecoder.load options: 2 threads, batch 1, pre-packed unless --no-prepack, --drafter."""
    opts = dict(threads=2, max_batch=1, prepack=not a.no_prepack)
    if a.drafter:
        opts["drafter"] = a.drafter
    return opts


def read(a: argparse.Namespace) -> list[dict]:
    """The prompts (jsonl rows), every n-th to --prompts-n."""
    prompts = [json.loads(line) for line in open(a.prompts)]
    if a.prompts_n:
        prompts = prompts[::max(1, len(prompts) // a.prompts_n)][:a.prompts_n]
    return prompts


def warm_up(decoders, prompts: list[dict]) -> None:
    """Two short auto generations per decoder (sessions, graphs and autok's first costs), excluded from timing."""
    for p in prompts[:2]:
        for d in decoders:
            d.generate(p["prompt"], max_new_tokens=16, chat=True, k="auto")


def set_field(obj, key: str, text: str, item: str) -> None:
    """obj.key = the JSON value text (true, 0.05, 64, [4, 8], "a string"; a list for a tuple field becomes a
    tuple; key may be a path, e.g. costs.keep); a value that is not JSON exits with a one-line error naming
    `item` (the option as given)."""
    *parents, key = key.split(".")
    for p in parents:
        obj = getattr(obj, p, None)
    if obj is None or not hasattr(obj, key) or callable(getattr(obj, key)):
        sys.exit(f"error: {item!r}: no such field (a method is not one)")
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        sys.exit(f"error: {item!r}: the value must be JSON (true, 0.05, 64, [4, 8]); a string in quotes")
    now = getattr(obj, key)
    if isinstance(now, tuple) and isinstance(value, list):
        value = tuple(value)
    kinds = (bool,) if isinstance(now, bool) else (int,) if isinstance(now, int) else (int, float) \
        if isinstance(now, float) else None
    if kinds and (not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds):
        sys.exit(f"error: {item!r}: the field holds a {type(now).__name__} ({now!r})")
    try:
        setattr(obj, key, value)
    except AttributeError:
        sys.exit(f"error: {item!r}: the field is read-only")
