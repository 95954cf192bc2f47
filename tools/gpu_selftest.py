#!/usr/bin/env python
"""GPU self-test: one script, one GPU, under 5 minutes, torch and numpy only (no files; transformers for --hf).

    python tools/gpu_selftest.py            # on a CUDA machine
    python tools/gpu_selftest.py --hf       # + transformers' generate on the same weights (needs transformers)
    python tools/gpu_selftest.py --only-gguf --gguf M.gguf   # a trained model against transformers
    python tools/gpu_selftest.py --cpu      # a quick dry run of the same table on the CPU (tiny models only)

It prints one table:
- exact: greedy tokens of tiny random models (built from configs in code, models/decoder.random_decoder) on the
  device, target-only and speculative (prompt lookup, a draft model, the two as a hybrid at k = 4 and at auto),
  with and without CUDA graphs, fp32 and bf16, against the CPU eager reference of the same model and dtype
  (target-only). A difference at a position where the reference's top-2 logits are within a rounding step counts
  as a tie (reported, not failed).
- speed: target-only against speculative (prompt lookup) at batch 1 and 8, with and without CUDA graphs, on a
  larger random model (--speed-model): the decode steps timed with CUDA events after a warm-up run, tokens/s,
  speed-up over target-only, mean tokens per step, and the share of each step spent outside kernels
  (1 - device time of the graph replays / step time; graphs only: eager steps have no replay to time).
  Random weights: the model's greedy output falls into loops that prompt lookup then predicts, so the
  acceptance (and the speed-up) says how the runtime does at that acceptance, not what a trained model gets.
  same: rows whose speculative tokens equal target-only's (the lossless check on the speed model).
- hf (--hf): transformers' generate, plain and prompt lookup, against this runtime with CUDA graphs on one
  random transformers Llama of the speed model's shape, batch 1 (hf_rows).
- gguf (--gguf PATH): a trained model. The GGUF, dequantized to fp32, through this runtime with CUDA graphs
  against transformers' generate over the same file, on real prompts (--prompts, --prompts-n; gguf_rows).
  `--only-gguf` skips the other rows. Needs transformers and gguf.
Then one line per backend this script does not exercise that is not installed here (onnxruntime-gpu,
TensorRT). Without CUDA it says so and exits 0. Exit status 1 when an exactness check fails.

Targets on a GPU: host overhead < 5% of a step with CUDA graphs; speculative >= 1.5x target-only at batch 1
on the prompt-lookup-friendly prompt. Run on one H200 (torch 2.11, CUDA 13) in stop 42: the README's "CUDA graphs"
section has the figures.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's specexport, uninstalled too

import numpy as np  # noqa: E402
import torch  # noqa: E402

from specexport.backends.cuda_graphs import CudaRuntime, FakeRuntime  # noqa: E402
from specexport.backends.torch_engine import TorchEngine  # noqa: E402
from specexport.batch import Batch  # noqa: E402
from specexport.config import DecoderConfig  # noqa: E402
from specexport.drafters import HybridDrafter, ModelDrafter, PromptLookupDrafter  # noqa: E402
from specexport.models.config import ModelConfig  # noqa: E402
from specexport.models.decoder import KVCache, random_decoder  # noqa: E402
from specexport.runtime import SpeculativeDecoder  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TIE_MARGIN = {"fp32": 1e-3, "bf16": 0.125}  # top-2 logit gaps a different kernel's rounding may flip

TINY = dict(model_type="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=32)
TINY_QWEN3 = dict(TINY, model_type="qwen3", qk_norm=True, num_layers=3)
SPEED = {  # the speed model's shape (random weights, tied embeddings), built on the device
    "8b": dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
               num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0, tie_word_embeddings=True),
    "1b": dict(model_type="llama", vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_layers=16,
               num_heads=16, num_kv_heads=4, head_dim=128, tie_word_embeddings=True),
    "tiny": dict(TINY, tie_word_embeddings=True),
}


def prompts(V: int, n: int, seed: int = 0) -> list[list[int]]:
    """n prompts: a repeated passage (prompt-lookup friendly) and random ids."""
    g = np.random.default_rng(seed)
    out = []
    for i in range(n):
        passage = g.integers(3, V, 12).tolist()
        out.append(passage * 3 if i % 2 == 0 else g.integers(3, V, 30).tolist())
    return out


class Setup:
    """Where the engines run: device, graphs runtime, timer."""

    def __init__(self, cpu: bool):
        self.cpu = cpu
        self.device = torch.device("cpu" if cpu else "cuda")

    def runtime(self):
        return FakeRuntime() if self.cpu else CudaRuntime(self.device)

    def engine(self, model, dc: DecoderConfig, graphs: bool, vocab=None, role="target") -> TorchEngine:
        eng = TorchEngine(model, dc.max_batch, dc.cache_len, target_vocab=vocab)
        return eng.capture_steps(self.runtime(), role=role, time_replays=True) if graphs else eng

    def sync(self):
        if not self.cpu:
            torch.cuda.synchronize(self.device)


class _Events:
    def __init__(self):
        self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def start(self):
        self.a.record()

    def stop(self) -> float:
        self.b.record()
        self.b.synchronize()
        return self.a.elapsed_time(self.b)


class _Wall:
    def start(self):
        self.t = time.perf_counter()

    def stop(self) -> float:
        return (time.perf_counter() - self.t) * 1e3


def decoder(setup: Setup, target, draft, dc: DecoderConfig, graphs: bool, drafter: str) -> SpeculativeDecoder:
    d = None
    if drafter in ("model", "hybrid"):
        d = ModelDrafter(setup.engine(draft, dc, graphs, target.cfg.vocab_size, "draft"), "draft")
        if drafter == "hybrid":  # lookup where it matched 2+ tokens, the model for the other rows (one verify)
            d = HybridDrafter(PromptLookupDrafter(1, 3), d, min_match=2)
    elif drafter == "lookup":
        d = PromptLookupDrafter(1, 3)
    return SpeculativeDecoder(setup.engine(target, dc, graphs), d, dc)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for j, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return j
    return None if len(a) == len(b) else min(len(a), len(b))


def ref_margin(model, prompt: list[int], out: list[int], j: int, dc: DecoderConfig) -> float:
    """The CPU reference's top-2 logit gap where its token j was chosen (teacher-forced over prompt + out)."""
    seq = torch.tensor([prompt + out[:j]])
    cache = KVCache.allocate(model.cfg, 1, dc.cache_len, next(model.parameters()).dtype)
    with torch.inference_mode():
        logits = model(seq, torch.zeros(1, dtype=torch.long), cache, seq.shape[1])[0, -1]
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def exact_rows(setup: Setup, new: int) -> tuple[list[dict], bool]:
    rows, ok = [], True
    dc = DecoderConfig(k=4, max_seq_len=160, max_batch=4, prefill_chunk=32)
    for shape in (TINY, TINY_QWEN3):
        cfg = ModelConfig(**shape)
        ps = prompts(cfg.vocab_size, 3, seed=1)
        for dname, dtype in DTYPES.items():
            cpu_target = random_decoder(cfg, dc.cache_len, seed=1, logit_scale=6.0, dtype=dtype)
            cpu_draft = random_decoder(cfg, dc.cache_len, seed=2, like=cpu_target, noise=0.02, dtype=dtype)
            ref = [o.token_ids for o in decoder(Setup(True), cpu_target, None, dc, False, "none")
                   .generate(ps, new, speculative=False)]
            target = copy.deepcopy(cpu_target).to(setup.device)
            draft = copy.deepcopy(cpu_draft).to(setup.device)
            for graphs in (False, True):
                for mode in ("target-only", "lookup", "model", "hybrid", "hybrid auto"):
                    drafter, k = mode.split()[0], "auto" if mode.endswith("auto") else None
                    dec = decoder(setup, target, draft, dc, graphs, "none" if mode == "target-only" else drafter)
                    outs = dec.generate(ps, new, speculative=mode != "target-only", k=k)
                    verdict, acc = "ok", sum(o.stats.accepted for o in outs)
                    for p, o, r in zip(ps, outs, ref):
                        j = first_divergence(o.token_ids, r)
                        if j is None:
                            continue
                        m = ref_margin(cpu_target, p, r, j, dc) if j < len(r) else float("inf")
                        if m < TIE_MARGIN[dname]:
                            verdict = f"tie@{j} ({m:.2g})" if verdict == "ok" else verdict
                        else:
                            verdict, ok = f"FAIL@{j} (gap {m:.2g})", False
                            break
                    rows.append(dict(check="exact", model=cfg.model_type, dtype=dname, graphs=_on(graphs),
                                     mode=mode, B=len(ps), result=verdict, accepted=acc))
    return rows, ok


def speed_rows(setup: Setup, size: str, new: int, dtype: str) -> list[dict]:
    cfg = ModelConfig(**SPEED[size])
    dc = DecoderConfig(k=4, max_seq_len=512, max_batch=8, prefill_chunk=128)
    t0 = time.perf_counter()
    target = random_decoder(cfg, dc.cache_len, seed=3, dtype=DTYPES[dtype], device=setup.device)
    setup.sync()
    print(f"speed model {size}: {sum(p.numel() for p in target.parameters()) / 1e9:.2f}B parameters, random init "
          f"in {time.perf_counter() - t0:.1f} s")
    rows = []
    for B in (1, 8):
        ps = prompts(cfg.vocab_size, B, seed=4)
        ps = [ps[0]] * B  # every row the prompt-lookup friendly one
        base, plain = {}, {}
        for graphs in (False, True):
            dec = decoder(setup, target, None, dc, graphs, "lookup")
            for mode in ("target-only", "lookup"):
                spec = mode != "target-only"
                decode(dec, ps, new, spec)  # warm-up (captures the graphs)
                ms, steps, tokens, device_ms, outs = decode(dec, ps, new, spec)
                tps = tokens / ms * 1e3
                base.setdefault(graphs, tps)
                want = plain.setdefault(graphs, outs)
                outside = f"{max(0.0, 1 - device_ms / ms):.1%}" if graphs else "-"
                rows.append(dict(check="speed", model=size, dtype=dtype,
                                 graphs=_on(graphs), mode=mode, B=B, result=f"{tps:,.0f} tok/s",
                                 speedup=f"{tps / base[graphs]:.2f}x", per_step=f"{tokens / steps / B:.2f}",
                                 step_ms=f"{ms / steps:.2f}", outside=outside,
                                 same=f"{sum(a == b for a, b in zip(outs, want))}/{B}"))
    del target
    return rows


def hf_rows(setup: Setup, size: str, new: int, dtype: str) -> list[dict]:
    """transformers' own generate (eager, its dynamic cache; plain and prompt lookup, 4 tokens) against this
    runtime with CUDA graphs on the same random weights (a transformers model of the speed model's shape, its
    state dict loaded into StaticKVDecoder), batch 1. Decode tok/s: (time of `new` tokens - time of 1) / (new - 1),
    each the best of 2 after a warm-up. same: this runtime's greedy tokens equal transformers' plain ones."""
    import transformers
    from specexport.models.decoder import StaticKVDecoder
    c = SPEED[size]
    hc = transformers.LlamaConfig(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
                                  intermediate_size=c["intermediate_size"], num_hidden_layers=c["num_layers"],
                                  num_attention_heads=c["num_heads"], num_key_value_heads=c["num_kv_heads"],
                                  head_dim=c["head_dim"], rope_theta=c.get("rope_theta", 10000.0),
                                  tie_word_embeddings=True, max_position_embeddings=2048, bos_token_id=None,
                                  eos_token_id=None)  # no EOS: transformers would mask it, and we don't
    dc = DecoderConfig(k=4, max_seq_len=512, max_batch=1, prefill_chunk=128)
    default = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[dtype])
    try:
        with torch.device(setup.device):
            torch.manual_seed(5)
            hf = transformers.LlamaForCausalLM(hc).eval().requires_grad_(False)
            hf.model.norm.weight.mul_(6.0)  # sharper distributions (as random_decoder's logit_scale)
            ours = StaticKVDecoder(ModelConfig.from_hf(hc.to_dict()), dc.cache_len)
    finally:
        torch.set_default_dtype(default)
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight" and "rotary" not in k}
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not unexpected and all(m == "lm_head.weight" or "rope" in m for m in missing), (missing, unexpected)
    ours = ours.eval().requires_grad_(False).fuse()
    ours._set_rope(DTYPES[dtype])
    ours.to(setup.device)
    p = prompts(c["vocab_size"], 1, seed=4)[0]
    ids = torch.tensor([p], device=setup.device)

    def hf_generate(n: int, **kw) -> tuple[float, list[int], list[torch.Tensor]]:
        best = float("inf")
        for _ in range(3):  # a warm-up, then the best of 2
            setup.sync()
            t = time.perf_counter()
            out = hf.generate(ids, max_new_tokens=n, do_sample=False, return_dict_in_generate=True,
                              output_logits=True, **kw)
            setup.sync()
            best = min(best, time.perf_counter() - t)
        return best, out.sequences[0, len(p):].tolist(), [x[0] for x in out.logits]

    rows, ref, ref_logits = [], None, None
    for name, kw in (("plain", {}), ("lookup", dict(prompt_lookup_num_tokens=4))):
        t1, _, _ = hf_generate(1, **kw)
        tn, toks, logits = hf_generate(new, **kw)
        if ref is None:
            ref, ref_logits = toks, logits
        tps = (new - 1) / (tn - t1)
        rows.append(dict(check="hf", model=f"{size} transformers", dtype=dtype, graphs="off", mode=name, B=1,
                         result=f"{tps:,.0f} tok/s", step_ms=f"{(tn - t1) / (new - 1) * 1e3:.2f}",
                         same=_same(toks, ref, ref_logits)))
    dec = decoder(setup, ours, None, dc, True, "lookup")
    for mode in ("target-only", "lookup"):
        spec = mode != "target-only"
        decode(dec, [p], new, spec)
        ms, steps, tokens, _, outs = min((decode(dec, [p], new, spec) for _ in range(2)), key=lambda r: r[0])
        rows.append(dict(check="hf", model=f"{size} specexport", dtype=dtype, graphs="on", mode=mode, B=1,
                         result=f"{tokens / ms * 1e3:,.0f} tok/s", per_step=f"{tokens / steps:.2f}",
                         step_ms=f"{ms / steps:.2f}", same=_same(outs[0], ref, ref_logits)))
    return rows


def gguf_rows(setup: Setup, path: str, prompt_file: str, n: int, new: int) -> tuple[list[dict], bool]:
    """A trained model: a GGUF, dequantized to fp32, through this runtime with CUDA graphs (target-only, prompt
    lookup at k = 8 and at k="auto") against transformers' generate over the same GGUF (fp32, eager; plain and its
    prompt lookup, 8 tokens), batch 1, greedy, the chat template, the first n prompts of prompt_file, `new` tokens
    each (EOS stops neither: both run greedy past it). Decode tok/s over all prompts: tokens after the first over
    their time (transformers: t(new) - t(1) per prompt, after one warm-up). same: prompts whose tokens equal
    transformers' plain ones; a difference fails the check unless transformers' top-2 gap there is a tie
    (TIE_MARGIN fp32)."""
    import json

    import transformers
    from specexport.models.loading import load_model
    dc = DecoderConfig(k=8, max_seq_len=1024, max_batch=1, prefill_chunk=128)
    loaded = load_model(path, "fp32", dc.cache_len)
    model = loaded.model.to(setup.device)
    dec = SpeculativeDecoder(setup.engine(model, dc, True), PromptLookupDrafter(1, 3), dc, loaded.tokenizer,
                             loaded.config.eos_token_ids)
    ps = [json.loads(line) for line in open(prompt_file)]
    ps = sorted(ps, key=lambda r: int(r["id"].rsplit("-", 1)[-1]) if r["id"].rsplit("-", 1)[-1].isdigit() else 0)
    ps = [dec.encode(r["prompt"], chat=True) for r in ps[:n]]  # (the first of each category first)
    src = Path(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32,
                                                           local_files_only=True).to(setup.device).eval()
    hf.generation_config.eos_token_id = None  # run to `new` tokens, as ours does (no min_new_tokens: it masks EOS)
    hf.generation_config.pad_token_id = 0

    def hf_generate(ids: list[int], m: int, **kw):
        x = torch.tensor([ids], device=setup.device)
        setup.sync()
        t = time.perf_counter()
        out = hf.generate(x, max_new_tokens=m, do_sample=False, return_dict_in_generate=True, output_logits=True,
                          **kw)
        setup.sync()
        return time.perf_counter() - t, out.sequences[0, len(ids):].tolist(), [v[0] for v in out.logits]

    rows, ok, refs = [], True, []
    name = src.stem.split(".")[0][:12]
    for mode, kw in (("plain", {}), ("lookup", dict(prompt_lookup_num_tokens=8))):
        hf_generate(ps[0], new, **kw)  # warm-up
        secs, same = 0.0, 0
        for i, ids in enumerate(ps):
            t1 = hf_generate(ids, 1, **kw)[0]
            tn, toks, logits = hf_generate(ids, new, **kw)
            secs += tn - t1
            if mode == "plain":
                refs.append((toks, logits))
            same += toks == refs[i][0]
        tps = len(ps) * (new - 1) / secs
        rows.append(dict(check="gguf", model=f"{name} hf", dtype="fp32", graphs="off", mode=mode, B=1,
                         result=f"{tps:,.0f} tok/s", step_ms=f"{secs / len(ps) / (new - 1) * 1e3:.2f}",
                         same="ref" if mode == "plain" else f"{same}/{len(ps)}"))
    base = None
    for mode, k in (("target-only", None), ("lookup", None), ("lookup auto", "auto")):
        spec = mode != "target-only"
        decode(dec, ps[:1], new, spec, k)  # warm-up (captures the graphs; auto: its first costs)
        ms = steps = tokens = device_ms = same = 0
        for ids, (ref, logits) in zip(ps, refs):
            m, s, t, d, outs = decode(dec, [ids], new, spec, k)
            ms, steps, tokens, device_ms = ms + m, steps + s, tokens + t, device_ms + d
            j, gap = _divergence(outs[0], ref, logits)
            same += j is None
            if j is not None and (len(outs[0]) != len(ref) or gap is None or gap >= TIE_MARGIN["fp32"]):
                ok = False
                print(f"gguf {mode}: tokens differ from transformers' at {j} ({len(outs[0])} against "
                      f"{len(ref)} tokens" + ("" if gap is None else f"; its top-2 gap there {gap:.2g}") + ")")
        tps = tokens / ms * 1e3
        base = base or tps
        rows.append(dict(check="gguf", model=f"{name} ours", dtype="fp32", graphs="on", mode=mode, B=1,
                         result=f"{tps:,.0f} tok/s", speedup=f"{tps / base:.2f}x", per_step=f"{tokens / steps:.2f}",
                         step_ms=f"{ms / steps:.2f}", outside=f"{max(0.0, 1 - device_ms / ms):.1%}",
                         same=f"{same}/{len(ps)}"))
    return rows, ok


def _same(toks: list[int], ref: list[int], ref_logits: list[torch.Tensor]) -> str:
    """'=' when equal to transformers' tokens, else the first position where they differ and transformers' top-2
    logit gap there (a tie when it is within the dtype's rounding)."""
    j, gap = _divergence(toks, ref, ref_logits)
    return "=" if j is None else f"@{j}" if gap is None else f"@{j} ({gap:.2g})"


def _divergence(toks: list[int], ref: list[int], ref_logits: list[torch.Tensor]) -> tuple[int | None, float | None]:
    """(the first position where toks differ from ref, the reference's top-2 logit gap there) or (None, None)."""
    j = first_divergence(toks, ref)
    if j is None or j >= len(ref_logits):
        return j, None
    top = ref_logits[j].float().topk(2).values
    return j, float(top[0] - top[1])


def decode(dec: SpeculativeDecoder, ps, new: int, speculative: bool, k: int | str | None = None):
    """The decode steps of one batch (prefill excluded) at k (default: the config's), timed with CUDA events
    (wall clock on the CPU) -> (ms, steps, decoded tokens, device ms of graph replays, each row's tokens)."""
    reqs = dec._prepare(ps, new, None, False, (), ignore_eos=True)
    batch = Batch(dec, speculative, k or dec.config.k)
    batch.admit(list(range(len(reqs))), reqs)
    engines = [dec.target] + ([dec.drafter.engine] if getattr(dec.drafter, "engine", None) is not None else [])
    graphs = [e.graphs for e in engines if e.graphs is not None]
    before = sum(g.device_ms for g in graphs)
    clock = _Events() if dec.target.device.type == "cuda" else _Wall()
    steps = 0
    clock.start()
    while batch.rows():
        batch.step()
        steps += 1
    ms = clock.stop()
    tokens = sum(len(r.out) - 1 for r in reqs)  # the first token comes from prefill
    return ms, steps, tokens, sum(g.device_ms for g in graphs) - before, [list(r.out) for r in reqs]


def _on(graphs: bool) -> str:
    return "on" if graphs else "off"


COLUMNS = [("check", 5), ("model", 17), ("dtype", 5), ("graphs", 6), ("mode", 11), ("B", 2), ("result", 22),
           ("accepted", 8), ("speedup", 7), ("per_step", 8), ("step_ms", 7), ("outside", 7), ("same", 12)]


def table(rows: list[dict]) -> str:
    head = "  ".join(f"{c:<{w}}" for c, w in COLUMNS)
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append("  ".join(f"{str(r.get(c, '')):<{w}}" for c, w in COLUMNS))
    return "\n".join(lines)


def backend_lines() -> list[str]:
    lines = []
    try:
        import onnxruntime as ort
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            lines.append(f"onnxruntime-gpu: not installed (onnxruntime {ort.__version__} has no CUDA provider); "
                         "pip install onnxruntime-gpu to run engines with backend=onnxruntime, device='cuda'")
    except ImportError:
        lines.append("onnxruntime-gpu: not installed (pip install onnxruntime-gpu)")
    if importlib.util.find_spec("tensorrt") is None:
        lines.append("TensorRT: not installed (pip install tensorrt)")
    return lines


def main(argv=None) -> int:
    return run(argv)[0]


def run(argv=None) -> tuple[int, list[dict]]:
    """-> (exit status, the table's rows)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="dry run on the CPU: tiny models, FakeRuntime graphs")
    ap.add_argument("--speed-model", choices=sorted(SPEED), default="8b", help="the speed rows' model (GPU)")
    ap.add_argument("--new", type=int, default=None, help="new tokens per request (default 48 GPU, 12 CPU)")
    ap.add_argument("--hf", action="store_true", help="also transformers' generate on the same weights (batch 1; "
                    "needs transformers)")
    ap.add_argument("--gguf", default=None, metavar="PATH", help="a trained model's GGUF: this runtime against "
                    "transformers on it (fp32, the prompts of --prompts; needs transformers and gguf)")
    ap.add_argument("--prompts", default=str(Path(__file__).resolve().parents[2] / "shared/bench/prompts.jsonl"))
    ap.add_argument("--prompts-n", type=int, default=24, help="--gguf: the first this many prompts")
    ap.add_argument("--only-gguf", action="store_true", help="--gguf rows alone (no exact and speed rows)")
    args = ap.parse_args(argv)
    if args.only_gguf and not args.gguf:
        ap.error("--only-gguf needs --gguf PATH (a GGUF file)")
    if not args.cpu and not torch.cuda.is_available():
        print(f"CUDA is not available (torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}): "
              "nothing to test on a GPU here. `--cpu` runs the same table on the CPU as a dry run.")
        return 0, []
    setup = Setup(args.cpu)
    new = args.new or (12 if args.cpu else 48)
    t0 = time.perf_counter()
    where = "CPU dry run (FakeRuntime stands in for CUDA graphs)" if args.cpu else torch.cuda.get_device_name()
    print(f"specexport GPU self-test: {where}; torch {torch.__version__}")
    rows, ok = [], True
    if not args.only_gguf:
        rows, ok = exact_rows(setup, new)
        size, speed_new, dtype = ("tiny", new, "fp32") if args.cpu else (args.speed_model, 4 * new, "bf16")
        rows += speed_rows(setup, size, speed_new, dtype)
        if args.hf:
            rows += hf_rows(setup, size, speed_new, dtype)
    if args.gguf:
        more, gguf_ok = gguf_rows(setup, args.gguf, args.prompts, args.prompts_n, args.new or 128)
        rows, ok = rows + more, ok and gguf_ok
    print(table(rows))
    for line in backend_lines():
        print(line)
    print(f"{'all exactness checks passed' if ok else 'EXACTNESS FAILED'} in {time.perf_counter() - t0:.0f} s")
    return (0 if ok else 1), rows


if __name__ == "__main__":
    sys.exit(main())
