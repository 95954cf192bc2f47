"""`specexport bench --peers llama.cpp,ort-genai`: specexport against its peers on the same GGUF, side by side.

Systems, grouped by bit width (every system on a prompt before the next prompt, in orders where each follows
every other equally often (a Williams design), warm-up excluded):
  fp32   hf_generate (transformers fp32 over the dequantized GGUF: the fidelity reference),
         se-fp32 target-only and prompt lookup @auto (the dequantized engine, --dtype fp32),
         se-fp32-int8 hybrid @auto (the same fp32 target with the quant:int8:b128:asym copy as its draft model:
         its default drafter, prompt lookup where it matches and the copy elsewhere),
         ort-genai-fp32 plain and +ngram<n> (its model builder's fp32 model from the same GGUF)
  4-bit  se-gguf target-only and prompt lookup @auto (the GGUF's Q4_1/Q8_0 codes as stored, int8 activations),
         se-int4 likewise (--target-quant int4:b32:sym: the dequantized GGUF re-quantized, in the format of
         ORT GenAI's int4: symmetric, block 32),
         se-gguf-fp32act target-only (the GGUF's codes, fp32 activations: the fidelity row),
         llama.cpp plain and +lookup<n> (the GGUF as stored), ort-genai-int4 plain and +ngram<n> (its own int4)
Decode tokens/s exclude prefill for every system (the first new token belongs to prefill), as in
GenerationStats; transformers' rate is end to end. The report gives per-category geometric means, the ratios
the fast-engines targets name, and how many prompts each system decodes exactly as transformers fp32 does.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SpecExportError
from .report import geomean, run_order


SAME_TARGET = {"se-fp32-int8": "se-fp32"}  # an engine with a draft model -> the engine of the same target


@dataclass
class VersusConfig:
    prompts: str
    engines: dict[str, str]  # label (se-fp32, se-gguf, se-gguf-fp32act) -> engine folder
    gguf: str  # the GGUF every system reads
    peers: tuple[str, ...] = ("llama.cpp", "ort-genai")
    lookup: tuple[int, ...] = (4,)  # draft lengths for the peers' lookup / n-gram modes
    max_new_tokens: int = 128
    per_category: int = 0
    reps: int = 1
    threads: int = 2
    hf: bool = True
    ort_dir: str | None = None


@dataclass
class System:
    name: str
    group: str  # "fp32" | "4-bit" (bit width of the weights it decodes)
    run: object = field(repr=False)  # ids -> (tokens, decode_s or None, prefill_s or None)
    plain: str | None = None  # for a speculative mode, its own non-speculative system (lossless check)


def _se(dec, speculative: bool, k, n: int):
    def run(ids):
        o = dec.generate(ids, max_new_tokens=n, speculative=speculative, k=k if speculative else None)[0]
        return o.token_ids, o.stats.decode_s, o.stats.prefill_s
    return run


def build_systems(cfg: VersusConfig, log=print) -> tuple[list[System], object]:
    from ..runtime import SpeculativeDecoder
    from .peers import build_peers
    systems, base = [], None
    for label, path in cfg.engines.items():
        dec = SpeculativeDecoder.load(path, max_batch=1, prepack=True, threads=cfg.threads, preload=True)
        base = base or dec
        group = "fp32" if label.startswith("se-fp32") else "4-bit"
        if getattr(dec.drafter, "engine", None) is not None:  # a draft model: only its default drafter, the hybrid
            plain = SAME_TARGET.get(label)  # the engine with the same target (its target-only tokens)
            systems.append(System(f"{label}/hybrid@auto", group, _se(dec, True, "auto", cfg.max_new_tokens),
                                  plain=f"{plain}/target-only" if plain in cfg.engines else None))
            continue
        systems.append(System(f"{label}/target-only", group, _se(dec, False, None, cfg.max_new_tokens)))
        if label != "se-gguf-fp32act":
            systems.append(System(f"{label}/lookup@auto", group, _se(dec, True, "auto", cfg.max_new_tokens),
                                  plain=f"{label}/target-only"))
    if cfg.hf:
        import torch
        from .runner import _hf_model
        hf = _hf_model(cfg.gguf)

        def hf_run(ids):
            x = torch.tensor([ids])
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=cfg.max_new_tokens,
                                  do_sample=False)
            return out[0, len(ids):].tolist(), None, time.perf_counter() - t0
        systems.insert(0, System("hf_generate", "fp32", hf_run))
    wanted = set(cfg.peers)
    for n in cfg.lookup:
        for name, peer in build_peers(cfg.gguf, cfg.ort_dir, cfg.threads, n, log=log).items():
            plain = name.split("+")[0]
            if plain.split("-")[0] not in {w.split("-")[0] for w in wanted}:
                continue
            if "+" not in name and any(s.name == name for s in systems):
                continue  # the plain mode once, whatever the lookup lengths
            group = "fp32" if name.startswith("ort-genai-fp32") else "4-bit"
            systems.append(System(name, group, lambda ids, p=peer: p.generate(ids, cfg.max_new_tokens),
                                  plain=plain if "+" in name else None))
    return systems, base


def run_versus(cfg: VersusConfig, log=print) -> dict:
    from tqdm import tqdm
    from .runner import read_prompts
    prompts = read_prompts(cfg.prompts, cfg.per_category)
    systems, base = build_systems(cfg, log)
    warm = base.encode("Say hello in one short sentence.", chat=True)
    for s in systems:
        s.run(warm)
    records = []
    bar = tqdm(total=len(prompts) * len(systems) * cfg.reps, unit="run", file=sys.stderr)
    for rep in range(cfg.reps):
        for i, p in enumerate(prompts):
            ids = base.encode(p["prompt"], chat=True)
            order = run_order(systems, rep * len(prompts) + i)
            rec = {"id": p["id"], "category": p["category"], "rep": rep, "prompt_tokens": len(ids),
                   "order": [s.name for s in order], "systems": {}}
            for s in order:
                bar.set_description(f"{p['id']} {s.name}")
                t0 = time.perf_counter()
                toks, dec_s, pre_s = s.run(ids)
                wall = time.perf_counter() - t0
                if dec_s:  # decode rate, prefill excluded
                    rate = (len(toks) - 1) / dec_s if len(toks) > 1 else 0.0
                else:  # (transformers: end to end)
                    rate = len(toks) / wall
                rec["systems"][s.name] = {"tokens": toks, "decode_tokens_per_s": rate, "seconds": wall}
                bar.update()
            records.append(rec)
    bar.close()
    return {"config": {**cfg.__dict__, "peers": list(cfg.peers), "lookup": list(cfg.lookup)},
            "systems": [{"name": s.name, "group": s.group, "plain": s.plain} for s in systems], "records": records}


# ---- report ---------------------------------------------------------------------------------------------

def summarize(result: dict) -> dict:
    recs, systems = result["records"], result["systems"]
    names = [s["name"] for s in systems]
    cats = sorted({r["category"] for r in recs})
    rate = {c: {n: geomean([r["systems"][n]["decode_tokens_per_s"] for r in recs if c in ("all", r["category"])])
                for n in names} for c in cats + ["all"]}
    ref = "hf_generate" if "hf_generate" in names else None
    first = [r for r in recs if r["rep"] == 0]
    same_as_hf = {n: sum(r["systems"][n]["tokens"] == r["systems"][ref]["tokens"] for r in first) if ref else None
                  for n in names}
    same_as_plain = {s["name"]: sum(r["systems"][s["name"]]["tokens"] == r["systems"][s["plain"]]["tokens"]
                                    for r in recs) for s in systems if s["plain"]}
    return {"categories": cats, "systems": systems, "rate": rate, "n": len(first), "runs": len(recs),
            "same_as_hf": same_as_hf, "same_as_plain": same_as_plain, "targets": targets(rate, cats, names)}


def targets(rate: dict, cats: list[str], names: list[str]) -> list[dict]:
    """The fast-engines issue's targets, each as (what, measured ratio, goal), from the 'all' geomeans."""
    a = rate["all"]
    out = []

    def add(what, num, den, goal):
        if num in a and all(d in a for d in den) and den:
            d = max(den, key=lambda x: a[x])
            out.append({"target": what, "ours": num, "theirs": d, "ratio": a[num] / a[d] if a[d] else 0.0,
                        "goal": goal})

    peers = [n for n in names if n.startswith(("llama.cpp", "ort-genai"))]
    add("fp32 target-only vs ORT GenAI fp32", "se-fp32/target-only", ["ort-genai-fp32"], 1.0)
    for label in ("se-gguf", "se-int4"):
        add(f"4-bit target-only ({label}) vs ORT GenAI int4", f"{label}/target-only", ["ort-genai-int4"], 1.0)
        add(f"4-bit target-only ({label}) vs llama.cpp plain", f"{label}/target-only", ["llama.cpp"], 1.5)
    for mode in ("se-fp32/lookup@auto", "se-fp32-int8/hybrid@auto"):
        add(f"fp32 speculative ({mode.split('/')[1]}) vs ORT GenAI fp32, best mode", mode,
            [n for n in peers if n.startswith("ort-genai-fp32")], 1.5)
    for label in ("se-gguf", "se-int4"):
        add(f"4-bit speculative ({label}) vs ORT GenAI int4, best mode", f"{label}/lookup@auto",
            [n for n in peers if n.startswith("ort-genai-int4")], 1.5)
        add(f"4-bit speculative ({label}) vs llama.cpp, best mode", f"{label}/lookup@auto",
            [n for n in peers if n.startswith("llama.cpp")], 1.5)
    for mode in ("se-fp32/lookup@auto", "se-fp32-int8/hybrid@auto"):  # each engine's default drafter at auto
        if mode in a and "se-fp32/target-only" in a:
            spec = {c: rate[c][mode] / rate[c]["se-fp32/target-only"] for c in cats}
            out.append({"target": f"fp32 {mode.split('/')[1]} vs own target-only (min category >= 1.3)",
                        "ours": mode, "theirs": "se-fp32/target-only", "ratio": a[mode] / a["se-fp32/target-only"],
                        "goal": 2.0, "min_category": min(spec.values()) if spec else 0.0})
    return out


def markdown(result: dict, s: dict) -> str:
    cfg, cats = result["config"], s["categories"]
    lines = ["# specexport vs peers", "",
             f"{s['n']} prompts x {cfg['reps']} repetition(s), greedy, chat template, batch 1, "
             f"{cfg['max_new_tokens']} new tokens, {cfg['threads']} threads, every system on a prompt before the "
             "next (orders from a Williams design: each system after every other equally often), warm-up "
             "excluded. Decode tokens/s (prefill excluded; transformers end to end), geometric mean.",
             "", "| system | bits | " + " | ".join(cats) + " | all | = transformers fp32 |",
             "|---|---|" + "---|" * (len(cats) + 2)]
    for sysm in s["systems"]:
        n = sysm["name"]
        same = s["same_as_hf"][n]
        same = "-" if same is None else f"{same}/{s['n']}"
        lines.append(f"| {n} | {sysm['group']} | " + " | ".join(f"{s['rate'][c][n]:.1f}" for c in cats + ["all"])
                     + f" | {same} |")
    lines += ["", "Speculative modes equal to their own plain mode (all runs): " +
              ", ".join(f"{k} {v}/{s['runs']}" for k, v in s["same_as_plain"].items()), "",
              "| target | ours | theirs (best) | ratio | goal | met |", "|---|---|---|---|---|---|"]
    for t in s["targets"]:
        extra = f" (min category {t['min_category']:.2f})" if "min_category" in t else ""
        met = t["ratio"] >= t["goal"] and t.get("min_category", 2.0) >= 1.3
        lines.append(f"| {t['target']} | {t['ours']} | {t['theirs']} | {t['ratio']:.2f}x{extra} | "
                     f"{t['goal']}x | {'yes' if met else 'no'} |")
    return "\n".join(lines) + "\n"


def write_versus(result: dict, out_dir: str) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    s = summarize(result)
    md = markdown(result, s)
    (out / "versus.json").write_text(json.dumps({"result": result, "summary": s}, indent=1))
    (out / "versus.md").write_text(md)
    return {"markdown": md, "files": [str(out / "versus.json"), str(out / "versus.md")]}


def check_peers(names: tuple[str, ...]) -> tuple[str, ...]:
    """Known peer names; an unavailable peer prints one line and is skipped."""
    from .peers import PEER_NAMES, available_peers
    unknown = [n for n in names if n not in PEER_NAMES]
    if unknown:
        raise SpecExportError(f"--peers {','.join(unknown)}: choose from {', '.join(PEER_NAMES)}")
    av = available_peers()
    keep = []
    for n in names:
        if av[n] is None:
            keep.append(n)
        else:
            print(f"[bench] skipping {n}: {av[n]}", file=sys.stderr)
    return tuple(keep)

