"""The benchmark's modes and its alternating run.

Modes (names are the report's row labels):
  hf_generate                transformers generate(do_sample=False), the exactness reference
  hf_prompt_lookup           generate(prompt_lookup_num_tokens=10), transformers' n-gram assisted mode
  hf_assistant_int8          generate(assistant_model=...) with a torch dynamic-int8 copy of the target: the
                             closest transformers can run on CPU to specexport's quant:int8 drafter
  target_only                specexport, one target pass per token
  target_only_again          the same again (with k=auto rows): the A/A control, the noise floor of a ratio
  <drafter>@k<k>, <drafter>@auto   specexport speculative, one drafter over the shared target engine (each
                                   draft model also as the hybrid prompt-lookup+<draft>)
  target_only[<b>], prompt-lookup@k<max k>[<b>]   --backends: the first engine on another backend (pt2, torch,
                                   torchscript), for its tok/s beside ONNX Runtime's (no prediction columns)
All specexport modes share one loaded target engine (ONNX Runtime); each quantized drafter comes from its own
engine folder, built once with the same k values. Greedy, chat template, batch 1.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..config import PROMPT_LOOKUP
from ..errors import SpecExportError
from .report import CONTROL, run_order

HF_LOOKUP_TOKENS = 10  # transformers' documented default for prompt_lookup_num_tokens


@dataclass
class BenchConfig:
    prompts: str
    engines: list[str]  # engine folders: the first gives the target (and its drafter); the rest their drafters
    max_new_tokens: int = 128
    per_category: int = 0  # first N prompts of each category (0: all)
    auto: bool = True
    hf: tuple[str, ...] = ("generate", "prompt_lookup", "assistant_int8")
    prepack: bool = True
    threads: int | None = None
    warmup: int = 1  # warm-up generations per mode, excluded
    reps: int = 1  # runs of every mode per prompt (alternating); a prompt's figures pool its runs
    backends: tuple[str, ...] = ()  # other backends of the first engine to time beside onnxruntime


@dataclass
class Mode:
    name: str
    drafter: str  # "transformers", "none" (target-only), "prompt-lookup", "quant:..."
    k: int | str  # 0 target-only; "auto"; HF modes: their draft length (0 for plain generate)
    run: Callable[[list[int]], tuple[list[int], object]] = field(repr=False)


def read_prompts(path: str, per_category: int = 0) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        raise SpecExportError(f"prompt file {path!r} does not exist: pass a JSONL file with id, category, prompt")
    rows = []
    for i, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecExportError(f"{path}:{i} is not JSON ({e.msg}): one object per line with id, category, "
                                  "prompt") from None
        if not isinstance(r, dict) or not isinstance(r.get("prompt"), str) or not r["prompt"]:
            raise SpecExportError(f"{path}:{i} needs a non-empty string 'prompt' (and optionally id, category)")
        rows.append({"id": str(r.get("id", i)), "category": str(r.get("category", "all")), "prompt": r["prompt"]})
    if not rows:
        raise SpecExportError(f"prompt file {path!r} has no prompts")
    if per_category:
        seen: dict[str, int] = {}
        rows = [r for r in rows if seen.setdefault(r["category"], 0) < per_category
                and not seen.__setitem__(r["category"], seen[r["category"]] + 1)]
    return rows


def _hf_model(source: str, dtype=torch.float32):
    """The same target in transformers, from the same local file (GGUF or checkpoint dir; never the hub)."""
    from transformers import AutoModelForCausalLM
    src = Path(source)
    if src.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=dtype,
                                                    local_files_only=True).eval()
    return AutoModelForCausalLM.from_pretrained(str(src), dtype=dtype, local_files_only=True).eval()


def build_modes(cfg: BenchConfig, log=print) -> tuple[list[Mode], object]:
    """-> (modes, the shared target decoder, for encoding prompts)."""
    from ..engine_dir import open_draft
    from ..drafters import HybridDrafter, PromptLookupDrafter
    from ..runtime import SpeculativeDecoder
    opts = dict(max_batch=1, prepack=cfg.prepack, threads=cfg.threads, preload=True)
    base = SpeculativeDecoder.load(cfg.engines[0], drafter=PROMPT_LOOKUP, **opts)
    ks = base.built_ks()
    target, dcfg = base.target, base.config
    m = json.loads((Path(cfg.engines[0]) / "manifest.json").read_text())
    source = m["models"]["target"]["source"]

    def decoder(drafter):
        d = SpeculativeDecoder(target, drafter, dcfg, base.tokenizer, base.eos_token_ids, base.source)
        d.can_sample = base.can_sample
        return d

    drafters = {PROMPT_LOOKUP: decoder(PromptLookupDrafter(dcfg.ngram_min, dcfg.ngram_max))}
    for path in cfg.engines:
        mm = json.loads((Path(path) / "manifest.json").read_text())
        if mm["drafter"] == PROMPT_LOOKUP:
            continue
        if mm["models"]["target"]["source"] != source:
            raise SpecExportError(f"engine {path} was built for another target ({mm['models']['target']['source']}) "
                                  f"than {cfg.engines[0]} ({source}): compare drafters of one target")
        drafter, dks = open_draft(path, **opts)
        if tuple(dks) != ks:
            raise SpecExportError(f"engine {path} has k values {list(dks)}, {cfg.engines[0]} has {list(ks)}: build "
                                  "all bench engines with the same --k")
        drafters[drafter.name] = decoder(drafter)
        hybrid = HybridDrafter(PromptLookupDrafter(dcfg.ngram_min, dcfg.ngram_max), drafter, dcfg.min_match,
                               dcfg.handover)
        drafters[hybrid.name] = decoder(hybrid)  # lookup where it matches, this model elsewhere

    def se(dec, k):
        def run(ids):
            o = dec.generate(ids, max_new_tokens=cfg.max_new_tokens, speculative=k != 0, k=k or None)[0]
            return o.token_ids, o.stats
        return run

    modes = [Mode("target_only", "none", 0, se(base, 0))]
    if cfg.auto:  # the A/A control: the same target-only runs again, to show the noise floor of per-prompt ratios
        modes.append(Mode(CONTROL, "none", 0, se(base, 0)))
    for name, dec in drafters.items():
        for k in ks:
            modes.append(Mode(f"{name}@k{k}", name, k, se(dec, k)))
        if cfg.auto:
            modes.append(Mode(f"{name}@auto", name, "auto", se(dec, "auto")))

    for b in cfg.backends:  # the same engine on another backend: target-only and prompt lookup, tok/s only
        other = SpeculativeDecoder.load(cfg.engines[0], backend=b, drafter=PROMPT_LOOKUP, max_batch=1,
                                        threads=cfg.threads)
        for name, k in (("target_only", 0), (f"{PROMPT_LOOKUP}@k{max(ks)}", max(ks))):
            run = se(other, k)
            modes.append(Mode(f"{name}[{b}]", f"{'none' if k == 0 else PROMPT_LOOKUP}[{b}]", k,
                              lambda ids, run=run: (run(ids)[0], None)))

    if cfg.hf:
        log("[bench] loading the transformers baselines from the same file")
        hf = _hf_model(source)

        def hf_run(**kw):
            def run(ids):
                x = torch.tensor([ids])
                with torch.inference_mode():
                    out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=cfg.max_new_tokens,
                                      do_sample=False, **kw)
                return out[0, len(ids):].tolist(), None
            return run

        hf_modes = []
        if "generate" in cfg.hf:
            hf_modes.append(Mode("hf_generate", "transformers", 0, hf_run()))
        if "prompt_lookup" in cfg.hf:
            hf_modes.append(Mode("hf_prompt_lookup", "transformers", HF_LOOKUP_TOKENS,
                                 hf_run(prompt_lookup_num_tokens=HF_LOOKUP_TOKENS)))
        if "assistant_int8" in cfg.hf:
            import copy
            import warnings
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notice
                assistant = torch.ao.quantization.quantize_dynamic(copy.deepcopy(hf), {torch.nn.Linear},
                                                                   dtype=torch.qint8)
            hf_modes.append(Mode("hf_assistant_int8", "transformers", "heuristic", hf_run(assistant_model=assistant)))
        modes = hf_modes + modes
    return modes, base


def pooled_stats(stats: list) -> dict:
    """GenerationStats of repeated runs as one: counts, seconds and histograms summed."""
    from ..runtime import GenerationStats
    total = GenerationStats(k=stats[0].k, accept_hist=[0] * len(stats[0].accept_hist),
                            proposed_hist=[0] * len(stats[0].proposed_hist))
    for st in stats:
        for f in ("prompt_tokens", "new_tokens", "steps", "drafted", "accepted", "rejected", "prefill_s", "draft_s",
                  "verify_s", "host_s"):
            setattr(total, f, getattr(total, f) + getattr(st, f))
        total.accept_hist = [a + b for a, b in zip(total.accept_hist, st.accept_hist)]
        total.proposed_hist = [a + b for a, b in zip(total.proposed_hist, st.proposed_hist)]
        for name in ("k_steps", "drafted_by", "accepted_by", "rejected_by", "steps_by"):
            for key, n in getattr(st, name).items():
                getattr(total, name)[key] = getattr(total, name).get(key, 0) + n
    return total.as_dict()


def run_bench(cfg: BenchConfig, log=print) -> dict:
    """All modes on every prompt, alternating (every mode on a prompt before the next prompt; the order per prompt
    run from a Williams design, report.run_order)."""
    from tqdm import tqdm
    prompts = read_prompts(cfg.prompts, cfg.per_category)
    modes, base = build_modes(cfg, log)
    chat = bool(getattr(base.tokenizer, "chat_template", None))  # the chat template where the model has one
    warm = base.encode("Say hello in one short sentence.", chat=chat)
    log(f"[bench] warm-up: {len(modes)} modes x {cfg.warmup} (excluded)")
    for mode in modes:
        for _ in range(cfg.warmup):
            mode.run(warm)
    records = []
    bar = tqdm(total=len(prompts) * len(modes) * cfg.reps, unit="run", file=sys.stderr)
    for i, p in enumerate(prompts):
        ids = base.encode(p["prompt"], chat=chat)
        rec = {"id": p["id"], "category": p["category"], "prompt_tokens": len(ids), "modes": {}}
        outs, runs = {}, {m.name: [] for m in modes}
        for rep in range(cfg.reps):
            for mode in run_order(modes, i * cfg.reps + rep):
                bar.set_description(f"{p['id']} {mode.name}")
                t0 = time.perf_counter()
                toks, st = mode.run(ids)
                runs[mode.name].append((len(toks), time.perf_counter() - t0, st))
                if outs.setdefault(mode.name, toks) != toks:
                    outs[mode.name] = None  # (a run that differs from the mode's first: never identical)
                bar.update()
        for mode in modes:
            n, wall = sum(r[0] for r in runs[mode.name]), sum(r[1] for r in runs[mode.name])
            r = {"tokens": n, "seconds": wall, "tokens_per_s": n / wall}
            if runs[mode.name][0][2] is not None:
                r["stats"] = pooled_stats([st for _, _, st in runs[mode.name]])
                r["decode_rates"] = [st.decode_rate for _, _, st in runs[mode.name]]  # per run, in run order
            rec["modes"][mode.name] = r
        ref = outs.get("hf_generate", outs["target_only"])
        rec["identical"] = {n: o == ref for n, o in outs.items()}
        records.append(rec)
    bar.close()
    return {"config": {**cfg.__dict__, "hf": list(cfg.hf)}, "threads": torch.get_num_threads(), "chat": chat,
            "modes": [{"name": m.name, "drafter": m.drafter, "k": m.k} for m in modes],
            "reference": "hf_generate" if "generate" in cfg.hf else "target_only", "records": records}
