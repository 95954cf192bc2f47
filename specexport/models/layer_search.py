"""`layers:auto`: choose which target layers a self-draft keeps, on calibration text the target writes itself.

  1. calibration: the target continues calibration.CALIBRATION_PROMPTS (none is in the bench set) greedily;
  2. agreement a(S): teacher-forced over that text, the share of generated positions where the draft that keeps
     layer set S gives the target's own next token (greedy acceptance, per token);
  3. cost c(S): one-token step time of the draft over the target's, from the measured cost of the model's head
     (embedding, final norm, lm_head) and of one layer (eager torch, batch 1);
  4. Leviathan's predicted speedup for k drafts per step: (1 - a^(k+1)) / ((1 - a) (k c + 1)), best k;
  5. search: every layer is dropped alone and ranked by the agreement left without it; the candidates are the
     sets that drop the m lowest-ranked layers (m = 1 .. L-1), each measured; the highest prediction wins.
The table is printed (stderr) and returned for the manifest.
"""

from __future__ import annotations

import sys
import time

import torch

from .calibration import NEW_TOKENS, calibration_texts
from .decoder import KVCache, StaticKVDecoder
from .loading import LoadedModel
from .layer_spec import format_layers
from .skip import skip_layers

KS = tuple(range(1, 9))


def leviathan(a: float, k: int, c: float) -> float:
    """Expected speedup of k drafts per step at per-token acceptance a and draft/target cost ratio c."""
    tokens = k + 1 if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)
    return tokens / (k * c + 1)


def search_layers(target: LoadedModel, ks: tuple[int, ...] = KS, show: bool = True) -> tuple[tuple[int, ...], dict]:
    """-> (the chosen kept layers, the report recorded in the manifest)."""
    model = target.model
    L = model.cfg.num_layers
    t0 = time.perf_counter()
    texts = calibration_texts(target)
    full = tuple(range(L))
    head_s, layer_s = _costs(model)
    base = head_s + L * layer_s

    def measure(keep):
        a = _agreement(skip_layers(model, keep), texts)
        c = (head_s + len(keep) * layer_s) / base
        k = max(ks, key=lambda k: leviathan(a, k, c))
        return {"keep": format_layers(keep), "layers": len(keep), "agreement": round(a, 4), "cost": round(c, 4),
                "k": k, "predicted": round(leviathan(a, k, c), 3)}

    alone = {i: _agreement(skip_layers(model, tuple(j for j in full if j != i)), texts) for i in full}
    order = sorted(full, key=lambda i: -alone[i])  # the layer whose absence costs the least agreement first
    rows = [measure(tuple(sorted(set(full) - set(order[:m])))) for m in range(1, L)]
    best = max(rows, key=lambda r: r["predicted"])
    keep = tuple(sorted(set(full) - set(order[:L - best["layers"]])))
    report = {"calibration": {"prompts": len(texts), "new_tokens": NEW_TOKENS,
                              "positions": sum(len(t) - p for t, p in texts)},
              "cost_s": {"head": round(head_s, 6), "layer": round(layer_s, 6)},
              "agreement_without": {str(i): round(alone[i], 4) for i in full},
              "table": rows, "chosen": best, "search_s": round(time.perf_counter() - t0, 1)}
    if show:
        print(format_search(report), file=sys.stderr, flush=True)
    return keep, report


def format_search(report: dict) -> str:
    cal = report["calibration"]
    lines = [f"layers:auto on {cal['prompts']} calibration prompts x {cal['new_tokens']} target tokens "
             f"({cal['positions']} positions); cost per layer {report['cost_s']['layer'] * 1e3:.2f} ms, head "
             f"{report['cost_s']['head'] * 1e3:.2f} ms; searched in {report['search_s']}s",
             f"  {'layers':>6} {'agreement':>9} {'cost':>6} {'k':>2} {'predicted':>9}  kept"]
    for r in report["table"]:
        mark = "  <- chosen" if r == report["chosen"] else ""
        lines.append(f"  {r['layers']:>6} {r['agreement']:>9.3f} {r['cost']:>6.3f} {r['k']:>2} "
                     f"{r['predicted']:>8.2f}x  {r['keep']}{mark}")
    if report["chosen"]["predicted"] < 1.0:
        lines.append(f"  note: no layer set is predicted to beat target-only here (best {report['chosen']['predicted']}"
                     "x): k=auto will mostly leave this draft unused; a deeper target, or prompt lookup, pays more")
    return "\n".join(lines)


@torch.inference_mode()
def _agreement(draft: StaticKVDecoder, texts: list[tuple[list[int], int]]) -> float:
    """Teacher-forced: the share of generated positions where the draft's argmax is the target's token."""
    hit = total = 0
    for ids, p in texts:
        T = len(ids)
        cache = KVCache.allocate(draft.cfg, 1, T, next(draft.parameters()).dtype)
        logits = draft(torch.tensor([ids]), torch.zeros(1, dtype=torch.long), cache, T)  # [1, T, V]
        pred = logits[0, p - 1:T - 1].argmax(-1)  # predictions of positions p .. T-1
        hit += int((pred == torch.tensor(ids[p:])).sum())
        total += T - p
    return hit / max(total, 1)


@torch.inference_mode()
def _costs(model: StaticKVDecoder, steps: int = 30) -> tuple[float, float]:
    """-> (head seconds, seconds per layer) of a one-token decode step at batch 1: the full model and the model
    with one layer, timed alternately (median of `steps`)."""
    L = model.cfg.num_layers
    runs = [(m, KVCache.allocate(m.cfg, 1, 64, next(m.parameters()).dtype), [])  # (model, cache, seconds)
            for m in (model, skip_layers(model, (0,)))]
    tok, past = torch.tensor([[1]]), torch.tensor([31])
    for i in range(steps + 3):
        for m, cache, times in runs:
            t = time.perf_counter()
            m(tok, past, cache, 64)
            if i >= 3:  # warm-up excluded
                times.append(time.perf_counter() - t)
    t_full, t_one = (sorted(times)[len(times) // 2] for _, _, times in runs)
    layer = max(t_full - t_one, 1e-9) / max(L - 1, 1)
    return max(t_one - layer, 0.0), layer
