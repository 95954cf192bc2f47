#!/usr/bin/env python
"""RSS of a loaded engine pair against the bytes of its weights plus its KV buffers.

Runs in this fresh process: imports, then (baseline) load the engine, generate (speculative and target-only),
then read the kernel's peak RSS (VmHWM) and the resident set after the runs (VmRSS, and its anonymous part,
RssAnon: the rest is the mapped weights files' pages, page cache the kernel can take back). Reports the ratios for
the whole process and for what the engine pair added over the imported libraries (Python + torch +
onnxruntime + transformers). The peak includes the load's transients: pre-packing reads the mapped weights
(their pages go back once every session has packed) while the packed copy is being made.

    python tools/engine_memory.py engines/smollm2 [--backend onnxruntime] [--prepack|--no-prepack] [--max-batch 1]

--draft-extra: what the draft model adds, as the difference of two fresh processes' resident sets after the runs,
one with drafter="model" and one with drafter="prompt-lookup" (the draft not loaded), against the target's weights.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine")
    ap.add_argument("--backend", default="onnxruntime")
    ap.add_argument("--prepack", action=argparse.BooleanOptionalAction, default=None, help="default: the runtime's")
    ap.add_argument("--max-batch", type=int, default=1)
    ap.add_argument("--drafter", default=None, help="model | hybrid | prompt-lookup (default: the engine's)")
    ap.add_argument("--draft-extra", action="store_true", help="the draft's extra resident memory (see above)")
    a = ap.parse_args()
    if a.draft_extra:
        return draft_extra(a)
    import onnxruntime  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from specexport import SpeculativeDecoder
    from specexport.export.inspect import describe
    baseline, anon_base = status("VmRSS"), status("RssAnon")
    opts = {"prepack": a.prepack} if a.prepack is not None else {}
    if a.drafter:
        opts["drafter"] = a.drafter
    dec = SpeculativeDecoder.load(a.engine, backend=a.backend, max_batch=a.max_batch, **opts)
    prompt = "Rewrite this code with a list comprehension:\n\ndef f(xs):\n    out = []\n    for x in xs:\n" \
             "        out.append(x * 2)\n    return out\n"
    dec.generate([prompt] * a.max_batch, max_new_tokens=64, chat=True, speculative=a.drafter != "prompt-lookup")
    dec.generate([prompt] * a.max_batch, max_new_tokens=64, chat=True, speculative=False)
    peak, steady, anon = status("VmHWM"), status("VmRSS"), status("RssAnon")
    info = describe(a.engine)
    weights = info["memory"]["weights_bytes"]
    kv = sum(m["kv_bytes_per_row"] for m in info["models"].values()  # (a draft over the target's cache has none)
             if not (m["kv_target_on_ort_cpu"] and a.backend == "onnxruntime")) * a.max_batch
    ort = a.backend == "onnxruntime"
    out = {"engine": a.engine, "backend": a.backend, "prepack": dec.target.prepack if ort else None,
           "shared_packs": getattr(dec.target, "capi", False), "max_batch": a.max_batch,
           "weights_mb": weights / 1e6, "kv_mb": kv / 1e6, "baseline_rss_mb": baseline / 1e6, "peak_rss_mb": peak / 1e6,
           "peak_over_weights_plus_kv": peak / (weights + kv),
           "engine_pair_over_weights_plus_kv": (peak - baseline) / (weights + kv), "rss_after_mb": steady / 1e6,
           "engine_pair_after_over_weights_plus_kv": (steady - baseline) / (weights + kv),
           # of that, the process's own memory (packed copies, caches, arenas) and the mapped weights files' pages
           # (file-backed page cache: what the kernel can take back under pressure)
           "engine_pair_after_anon_over_weights_plus_kv": (anon - anon_base) / (weights + kv),
           "engine_pair_after_file_mb": ((steady - baseline) - (anon - anon_base)) / 1e6}
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}, indent=1))


def draft_extra(a) -> None:
    argv = [sys.executable, __file__, a.engine, "--backend", a.backend, "--max-batch", str(a.max_batch)]
    if a.prepack is not None:
        argv.append("--prepack" if a.prepack else "--no-prepack")
    runs = {d: json.loads(subprocess.run(argv + ["--drafter", d], capture_output=True, text=True, check=True).stdout)
            for d in ("prompt-lookup", "model")}
    from specexport.export.inspect import describe
    target = describe(a.engine)["models"]["target"]["weights_bytes"] / 1e6
    extra = runs["model"]["rss_after_mb"] - runs["prompt-lookup"]["rss_after_mb"]
    print(json.dumps({"engine": a.engine, "draft_extra_rss_mb": round(extra, 1), "target_weights_mb": round(target, 1),
                      "draft_extra_over_target_weights": round(extra / target, 3)}, indent=1))


if __name__ == "__main__":
    main()
