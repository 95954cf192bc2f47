#!/usr/bin/env python
"""Side-by-side tokens/s on SmolLM2-135M: transformers generate (plain, prompt lookup) vs specexport
(target-only, speculative with prompt lookup) on the eager torch backend, and with --engine on a built engine
folder's onnxruntime backend (and --prepack: the same with ORT weight pre-packing). All modes run in one
process, alternating per prompt, warm-up excluded. Greedy, chat template, ../shared/bench/prompts.jsonl.
Host share: the part of a generation's wall time spent outside engine calls.

    python tools/bench.py --per-category 1 --max-new-tokens 128 --dtype fp32 --out bench-results
    specexport build --max-seq-len 1024 --max-batch 1 --out engines/smollm2 && \
        python tools/bench.py --engine engines/smollm2 --prepack
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specexport import SpeculativeDecoder  # noqa: E402
from specexport.config import DTYPES  # noqa: E402


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default=str(ROOT.parent / "shared" / "bench" / "prompts.jsonl"))
    ap.add_argument("--per-category", type=int, default=0, help="first N prompts of each category (0: all)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--engine", help="also run this engine folder on onnxruntime (built with max_batch >= 1)")
    ap.add_argument("--prepack", action="store_true", help="with --engine: also onnxruntime with pre-packing")
    ap.add_argument("--out", default="bench-results")
    a = ap.parse_args()

    rows = [json.loads(line) for line in Path(a.prompts).read_text().splitlines() if line.strip()]
    if a.per_category:
        seen = defaultdict(int)
        rows = [r for r in rows if (seen.__setitem__(r["category"], seen[r["category"]] + 1)
                                    or seen[r["category"]] <= a.per_category)]
    dec = SpeculativeDecoder.from_pretrained(None, "prompt-lookup", k=a.k, max_seq_len=1024, max_batch=1,
                                             dtype=a.dtype)
    from transformers import AutoModelForCausalLM
    src = Path(dec.source)
    hf = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                              dtype=getattr(torch, DTYPES[a.dtype])).eval()

    def hf_run(ids, **kw):
        x = torch.tensor([ids])
        with torch.inference_mode():
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=a.max_new_tokens,
                              do_sample=False, **kw)
        return out[0, len(ids):].tolist(), None

    def se_run(d, ids, speculative):
        busy = d.target.busy_s
        t0 = time.perf_counter()
        o = d.generate(ids, max_new_tokens=a.max_new_tokens, speculative=speculative)[0]
        wall = time.perf_counter() - t0
        o.stats.host_share = 1 - (d.target.busy_s - busy) / wall  # prompt lookup runs on the host: counted in
        return o.token_ids, o.stats

    modes = {
        "hf_generate": lambda ids: hf_run(ids),
        "hf_prompt_lookup": lambda ids: hf_run(ids, prompt_lookup_num_tokens=a.k),
        "se_target_only": lambda ids: se_run(dec, ids, False),
        "se_prompt_lookup": lambda ids: se_run(dec, ids, True),
    }
    if a.engine:
        ort_dec = SpeculativeDecoder.load(a.engine, backend="onnxruntime", max_batch=1)
        modes.update(ort_target_only=lambda ids: se_run(ort_dec, ids, False),
                     ort_prompt_lookup=lambda ids: se_run(ort_dec, ids, True))
        if a.prepack:
            pp_dec = SpeculativeDecoder.load(a.engine, backend="onnxruntime", max_batch=1, prepack=True)
            modes.update(ort_pp_target_only=lambda ids: se_run(pp_dec, ids, False),
                         ort_pp_prompt_lookup=lambda ids: se_run(pp_dec, ids, True))
    warm = dec.encode("Say hello.", chat=True)
    for fn in modes.values():  # warm-up, excluded
        fn(warm)

    results = []
    for r in rows:
        ids = dec.encode(r["prompt"], chat=True)
        rec = {"id": r["id"], "category": r["category"], "prompt_tokens": len(ids)}
        outs = {}
        for name, fn in modes.items():  # alternating: every mode runs on this prompt before the next prompt
            t0 = time.perf_counter()
            toks, st = fn(ids)
            dt = time.perf_counter() - t0
            outs[name] = toks
            rec[name] = {"tokens": len(toks), "seconds": dt, "tokens_per_s": len(toks) / dt}
            if st is not None:
                rec[name].update(acceptance_rate=st.acceptance_rate, mean_committed_per_step=st.mean_committed_per_step,
                                 accept_hist=st.accept_hist, host_share=st.host_share)
        ref = outs["hf_generate"]
        rec["identical_to_hf_generate"] = {n: o == ref for n, o in outs.items()}
        rec["speculative_identical_to_target_only"] = all(
            outs[n] == outs[n.replace("prompt_lookup", "target_only")] for n in outs
            if n.endswith("prompt_lookup") and not n.startswith("hf"))
        results.append(rec)
        print(json.dumps({k: (v if not isinstance(v, dict) else {kk: (round(vv, 3) if isinstance(vv, float) else vv)
                                                                  for kk, vv in v.items()}) for k, v in rec.items()}),
              flush=True)

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"bench-{a.dtype}.json").write_text(json.dumps({"args": vars(a), "results": results}, indent=1))
    cats = sorted({r["category"] for r in results})
    lines = [f"SmolLM2-135M-Instruct, {a.dtype}, greedy, chat template, max_new_tokens={a.max_new_tokens}, k={a.k}, "
             f"{len(results)} prompts, batch 1, {torch.get_num_threads()} threads; tok/s are geometric means; "
             "x: over se_target_only (eager torch, the same tokens); host: share of wall time outside engine calls",
             "", "| category | " + " | ".join(modes) + " | acceptance (lookup) | tokens/step (lookup) |",
             "|" + "---|" * (len(modes) + 3)]
    for c in cats + ["geomean (all)"]:
        sel = results if c.startswith("geomean") else [r for r in results if r["category"] == c]
        tps = {m: geomean([r[m]["tokens_per_s"] for r in sel]) for m in modes}
        cells = []
        for m in modes:
            cell = f"{tps[m]:.1f} ({tps[m] / tps['se_target_only']:.2f}x"
            if "host_share" in sel[0][m]:
                cell += f", host {statistics.mean(r[m]['host_share'] for r in sel):.1%}"
            cells.append(cell + ")")
        acc = [r["se_prompt_lookup"].get("acceptance_rate", 0) for r in sel]
        cps = [r["se_prompt_lookup"].get("mean_committed_per_step", 1) for r in sel]
        lines.append(f"| {c} | " + " | ".join(cells) + f" | {statistics.mean(acc):.2f} | {statistics.mean(cps):.2f} |")
    same = all(all(r["identical_to_hf_generate"].values()) for r in results)
    lossless = all(r["speculative_identical_to_target_only"] for r in results)
    lines += ["", f"specexport speculative tokens identical to specexport target-only: {lossless}",
              f"all modes identical to transformers generate: {same}"
              + ("" if same or a.dtype == "fp32" else " (bf16/fp16 kernels round differently from transformers')")]
    (out / f"bench-{a.dtype}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
