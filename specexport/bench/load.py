"""`specexport bench --clients 1,4,16`: throughput under load, in-process over the continuous batcher.

At each level N, N client threads each submit a request and the next one when it finishes (a closed loop),
until `requests` mixed prompts (the prompt set in order, repeated if short) are done. Modes: target-only,
speculative at k="auto" and at each --k value, over one loaded engine, and an A/A control: target-only again,
through a batcher of its own, whose ratio to target-only is the run's noise floor (a 2-core VM's load levels move
by 5-20% between runs, more than the rules under test change them). Every mode runs at a level before the next
level, in an order that rotates per repetition, with one warm-up round per level excluded. Throughput is
generated tokens over the wall time of the level, prefill included (a server's view); a mode's ratio to
target-only is the geometric mean of its ratios within each repetition (`x_per_rep`: those ratios). Greedy,
with the chat template where the model has one.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from dataclasses import dataclass

from .report import geomean
from .runner import read_prompts


@dataclass
class LoadConfig:
    prompts: str
    engine: str
    clients: tuple[int, ...] = (1, 4, 16)
    requests: int = 32  # requests per level and mode
    max_new_tokens: int = 64
    ks: tuple[int | str, ...] = ("auto", 4)  # speculative modes besides target-only
    reps: int = 1
    prepack: bool = True
    threads: int | None = None


def run_clients(clients: int, client) -> float:
    """Run `client` in `clients` threads at once; the wall seconds until every one has returned."""
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def _run_level(batcher, prompts: list[str], clients: int, max_new_tokens: int, chat: bool) -> dict:
    """Closed loop: `clients` threads, each with one request in flight, until every prompt is done."""
    from ..serve.batcher import Chunk
    work = iter(enumerate(prompts))
    lock = threading.Lock()
    outs: dict[int, list[int]] = {}
    stats, errors = [], []

    def client():
        while True:
            with lock:
                item = next(work, None)
            if item is None:
                return
            i, prompt = item
            done = threading.Event()
            toks: list[int] = []

            def on_chunk(c: Chunk):
                toks.extend(c.token_ids)
                if c.finished:
                    if c.stats is not None:
                        stats.append(c.stats)
                    if c.error:
                        toks.append(-1)
                    done.set()
            try:
                batcher.submit(prompt, on_chunk, max_new_tokens=max_new_tokens, chat=chat)
            except Exception as e:  # a bad request: reported after the level, never a hung client
                errors.append(e)
                return
            done.wait()
            outs[i] = toks

    wall = run_clients(clients, client)
    if errors:
        raise errors[0]
    n = sum(len(t) for t in outs.values())
    k_steps: dict = {}
    for s in stats:
        for k, v in s.k_steps.items():
            k_steps[str(k)] = k_steps.get(str(k), 0) + v
    return {"tokens": n, "seconds": wall, "tokens_per_s": n / wall, "outputs": [outs[i] for i in sorted(outs)],
            "k_steps": k_steps}


def run_load(cfg: LoadConfig, log=print) -> dict:
    from ..runtime import SpeculativeDecoder
    from ..serve.batcher import ContinuousBatcher
    dec = SpeculativeDecoder.load(cfg.engine, max_batch=max(cfg.clients), prepack=cfg.prepack, threads=cfg.threads,
                                  preload=True)
    chat = bool(getattr(dec.tokenizer, "chat_template", None))  # the chat template where the model has one
    rows = read_prompts(cfg.prompts)
    prompts = [r["prompt"] for r in itertools.islice(itertools.cycle(rows), cfg.requests)]
    modes = ["target_only", AA] + [f"k={k}" for k in cfg.ks]
    batchers = {m: ContinuousBatcher(dec, speculative=m.startswith("k="), k=_k(m) if m.startswith("k=") else None)
                for m in modes}
    levels = []
    try:
        for n in cfg.clients:
            log(f"[bench] {n} clients: warm-up (excluded)")
            for m in modes:
                _run_level(batchers[m], prompts[:n], n, cfg.max_new_tokens, chat)
            runs: dict = {m: [] for m in modes}
            for rep in range(cfg.reps):
                order = modes[rep % len(modes):] + modes[:rep % len(modes)]
                for m in order:
                    log(f"[bench] {n} clients, {m}, repetition {rep + 1}/{cfg.reps}")
                    runs[m].append(_run_level(batchers[m], prompts, n, cfg.max_new_tokens, chat))
            base = [r["tokens_per_s"] for r in runs["target_only"]]
            level = {"clients": n, "modes": {}}
            for m in modes:
                tps = geomean([r["tokens_per_s"] for r in runs[m]])
                per_rep = [r["tokens_per_s"] / b if b else 0.0 for r, b in zip(runs[m], base)]
                k_steps: dict = {}
                for r in runs[m]:
                    for k, v in r["k_steps"].items():
                        k_steps[k] = k_steps.get(k, 0) + v
                level["modes"][m] = {
                    "tokens_per_s": tps, "x_target_only": geomean(per_rep), "x_per_rep": per_rep, "k_steps": k_steps,
                    "identical": all(r["outputs"] == runs["target_only"][0]["outputs"] for r in runs[m])}
            levels.append(level)
    finally:
        for b in batchers.values():
            b.close()
    return {"config": {**cfg.__dict__}, "levels": levels}


AA = "target_only_aa"  # the A/A control: target-only against itself


def _k(mode: str) -> int | str:
    k = mode.split("=", 1)[1]
    return k if k == "auto" else int(k)


def markdown(result: dict) -> str:
    cfg = result["config"]
    modes = list(result["levels"][0]["modes"]) if result["levels"] else []
    lines = ["# specexport bench: throughput under load (continuous batching)", "",
             f"{cfg['requests']} mixed prompts per level and mode ({cfg['prompts']}), {cfg['max_new_tokens']} new "
             f"tokens each, greedy; engine {cfg['engine']}"
             f"{' (pre-packed)' if cfg['prepack'] else ''}; {cfg['reps']} repetition(s), modes alternating, warm-up "
             "excluded. tok/s: generated tokens over the level's wall time (prefill included); in brackets the "
             "geometric mean of the ratios to target-only within each repetition, and their range. "
             f"{AA}: target-only against itself, this run's noise floor.", "",
             "| clients | " + " | ".join(modes) + " | auto steps per k |", "|---|" + "---|" * (len(modes) + 1)]
    for lv in result["levels"]:
        cells = [f"{c['tokens_per_s']:.1f} ({c['x_target_only']:.2f}x{_spread(c)})"
                 f"{'' if c['identical'] else ' DIFFERS'}" for c in lv["modes"].values()]
        auto = lv["modes"].get("k=auto", {}).get("k_steps", {})
        lines.append(f"| {lv['clients']} | " + " | ".join(cells) + f" | {auto} |")
    return "\n".join(lines) + "\n"


def _spread(cell: dict) -> str:
    r = cell.get("x_per_rep") or []
    return f", {min(r):.2f}-{max(r):.2f}" if len(r) > 1 else ""


def write_load(result: dict, out: str) -> dict:
    import json
    from pathlib import Path
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    slim = {**result, "levels": [{**lv, "modes": {m: {k: v for k, v in c.items() if k != "outputs"}
                                                   for m, c in lv["modes"].items()}} for lv in result["levels"]]}
    (folder / "load.json").write_text(json.dumps(slim, indent=1))
    md = markdown(result)
    (folder / "load.md").write_text(md)
    print(md)
    print(f"written: {folder / 'load.json'}, {folder / 'load.md'}", file=sys.stderr)
    return slim
