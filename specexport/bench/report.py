"""Aggregate a bench run: per category and geometric mean, Leviathan's prediction vs the measurement.

Per prompt and speculative mode (terms as in specexport/autok):
  a          acceptance MLE: accepted / (accepted + rejections)
  E_pred     sum over steps of E(a, drafts proposed that step) / steps   (Leviathan's expected tokens per step);
             hybrid: per drafter, its steps x E(its own a, its mean proposal length), over all steps
  cost ratio (draft + verify + host seconds per step) / (target-only seconds per step, the same prompt)
  draft pass / target step: draft seconds per step / k over target-only (verify + host) seconds per step;
  verify / target step: verify seconds per step over the target-only verify seconds per step
  predicted  E_pred / cost ratio: the decode speedup the formula predicts
  measured   decode tokens/s over target-only decode tokens/s (prefill excluded on both sides, as in the formula);
             tok/s and "x target-only" columns are end to end (prefill included)
Per prompt and drafter with an auto row (`auto_vs_fixed`, decode rates, prefill excluded):
  auto / target-only   k="auto" over target-only on the same prompt: autok's guarantee is >= 0.97 on every one
  auto / best fixed k  over the fastest fixed k on that prompt (an oracle choice, so noise favours it: the
                       fastest of three noisy rates is faster than the k would be on a rerun)
  ... held out         with repetitions: in each, over the fixed k that was fastest on that prompt in the other
                       repetitions (chosen and timed on separate runs, so a lucky run cannot pick its own
                       winner; the median over repetitions)
  auto / best single k over the one fixed k with the best geometric mean over all prompts (what a deployment
                       that fixes k could pick, after the fact)
  auto / oracle        over the faster of target-only and the best fixed k
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from ..autok import expected_tokens

CONTROL = "target_only_again"  # the bench's A/A control mode: target-only run again


def geomean(xs) -> float:
    xs = [x for x in xs if x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else 0.0


def williams_rows(n: int) -> list[list[int]]:
    """A Williams design over n modes: orders in which every mode runs at every position equally often and follows
    every other mode equally often (once each for even n, over 2n orders for odd n), so neither a mode's place
    in the run nor the state its predecessor leaves (cores still spinning, caches, page cache) favours one mode."""
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(x + r) % n for x in first] for r in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 else rows


def run_order(items: list, i: int) -> list:
    """The modes' order for the i-th prompt run (a Williams design's row i, cycling)."""
    if not items:
        return []
    rows = williams_rows(len(items))
    return [items[j] for j in rows[i % len(rows)]]


def _decode_rate(st: dict) -> float:
    """Decode tokens per second (the first token comes from prefill)."""
    dec_s = st["draft_s"] + st["verify_s"] + st["host_s"]
    return (st["new_tokens"] - 1) / dec_s if dec_s > 0 else 0.0


def prediction(st: dict, base: dict) -> tuple[float, float, float]:
    """-> (a, predicted decode speedup, measured decode speedup) of one speculative run vs target-only."""
    a = st["acceptance_mle"]
    steps = max(st["steps"], 1)
    e_pred = sum(n * expected_tokens(a, d) for d, n in enumerate(st["proposed_hist"])) / steps
    by = st.get("steps_by", {})
    if len(by) > 1:  # hybrid: each drafter's own acceptance over its own steps (at its mean proposal length)
        e_pred = steps - sum(by.values())  # steps without a proposal commit one token
        for d, n in by.items():
            acc, rej = st["accepted_by"].get(d, 0), st["rejected_by"].get(d, 0)
            e_pred += n * expected_tokens(acc / (acc + rej) if acc + rej else 0.0, st["drafted_by"][d] / n)
        e_pred /= steps
    step_s = (st["draft_s"] + st["verify_s"] + st["host_s"]) / steps
    base_step_s = (base["draft_s"] + base["verify_s"] + base["host_s"]) / max(base["steps"], 1)
    predicted = e_pred / (step_s / base_step_s) if step_s > 0 and base_step_s > 0 else 0.0
    measured = _decode_rate(st) / _decode_rate(base) if _decode_rate(base) > 0 else 0.0
    return a, predicted, measured


def cost_ratios(st: dict, base: dict, k) -> tuple[float | None, float]:
    """-> (one draft pass / one target-only step, or None for prompt lookup and auto; verify step / target-only
    step), from the per-step seconds of one run and of the target-only run on the same prompt."""
    base_step = (base["verify_s"] + base["host_s"]) / max(base["steps"], 1)
    base_verify = base["verify_s"] / max(base["steps"], 1)
    steps = max(st["steps"], 1)
    if base_step <= 0 or base_verify <= 0:  # no decode step (first token EOS, max_new_tokens 1)
        return None, 0.0
    draft = st["draft_s"] / steps / k / base_step if isinstance(k, int) and k > 0 else None
    return draft, st["verify_s"] / steps / base_verify


def per_position(stats: list[dict]) -> list[float]:
    """[k]: pooled over runs, the share of i-th draft tokens accepted (vLLM's per-position acceptance)."""
    acc = [sum(col) for col in zip(*[s.get("accepted_per_pos", []) for s in stats])]
    drafted = [sum(col) for col in zip(*[s.get("drafted_per_pos", []) for s in stats])]
    return [a / d if d else 0.0 for a, d in zip(acc, drafted)]


def summarize(result: dict) -> dict:
    """Per mode and category: tok/s (geomean), x target-only, acceptance, tokens/step, predicted, measured."""
    recs = result["records"]
    cats = sorted({r["category"] for r in recs})
    modes = [m["name"] for m in result["modes"]]
    table: dict = {}
    for c in cats + ["all"]:
        sel = [r for r in recs if c == "all" or r["category"] == c]
        row = {}
        for m in modes:
            tps = geomean([r["modes"][m]["tokens_per_s"] for r in sel])
            base = geomean([r["modes"]["target_only"]["tokens_per_s"] for r in sel])
            cell = {"tokens_per_s": tps, "x_target_only": tps / base if base else 0.0,
                    "identical": sum(r["identical"][m] for r in sel), "n": len(sel)}
            if "stats" in sel[0]["modes"][m] and m != "target_only":
                sts = [r["modes"][m]["stats"] for r in sel]
                preds = [prediction(r["modes"][m]["stats"], r["modes"]["target_only"]["stats"]) for r in sel]
                cell.update(acceptance=sum(s["acceptance_rate"] for s in sts) / len(sts),
                            acceptance_mle=sum(p[0] for p in preds) / len(preds),
                            tokens_per_step=sum(s["mean_committed_per_step"] for s in sts) / len(sts),
                            predicted=geomean([p[1] for p in preds]), measured=geomean([p[2] for p in preds]))
                cell["measured_over_predicted"] = cell["measured"] / cell["predicted"] if cell["predicted"] else 0.0
                k = next(x["k"] for x in result["modes"] if x["name"] == m)
                ratios = [cost_ratios(r["modes"][m]["stats"], r["modes"]["target_only"]["stats"], k) for r in sel]
                cell["verify_cost_ratio"] = sum(v for _, v in ratios) / len(ratios)
                drafts = [d for d, _ in ratios if d is not None]
                if "prompt-lookup" not in m and drafts:
                    cell["draft_pass_cost_ratio"] = sum(drafts) / len(drafts)
                ksteps: dict = defaultdict(int)
                for s in sts:
                    for k, n in s["k_steps"].items():
                        ksteps[str(k)] += n
                cell["k_steps"] = dict(ksteps)
                cell["acceptance_per_pos"] = per_position(sts)
            row[m] = cell
        table[c] = row
    spec = [m for m in modes if "@" in m]
    hf_assisted = [m for m in modes if m.startswith("hf_") and m != "hf_generate"]
    best = {}
    for c in cats:
        if spec:
            bm = max(spec, key=lambda m: table[c][m]["tokens_per_s"])
            best[c] = {"mode": bm, "x_target_only": table[c][bm]["x_target_only"]}
            if hf_assisted:
                hm = max(hf_assisted, key=lambda m: table[c][m]["tokens_per_s"])
                best[c].update(hf_best=hm, x_hf_best=table[c][bm]["tokens_per_s"] / table[c][hm]["tokens_per_s"])
    # best drafter per category, geometric mean over every prompt of the set
    per_prompt = [r["modes"][best[r["category"]]["mode"]]["tokens_per_s"] / r["modes"]["target_only"]["tokens_per_s"]
                  for r in recs if r["category"] in best]
    return {"categories": cats, "modes": modes, "table": table, "best": best,
            "best_per_category_geomean_x": geomean(per_prompt) if per_prompt else 0.0, "auto": auto_vs_fixed(result)}


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def _held_out(rates, auto: str, fixed: list[str]) -> float | None:
    """Auto over the best fixed k chosen on other runs: for each repetition i, the fixed mode whose median rate over
    target-only in the other repetitions is highest, timed in repetition i; the median over i. None with one
    repetition (or unequal counts)."""
    base = rates("target_only")
    R = len(base)
    if R < 2 or any(len(rates(n)) != R for n in (auto, *fixed)):
        return None
    out = []
    for i in range(R):
        rest = [j for j in range(R) if j != i and base[j] > 0]
        pick = max(fixed, key=lambda n: _median([rates(n)[j] / base[j] for j in rest]) if rest else 0.0)
        if rates(pick)[i] > 0:
            out.append(rates(auto)[i] / rates(pick)[i])
    return _median(out) if out else None


def auto_vs_fixed(result: dict) -> dict:
    """Per drafter with an auto mode: per prompt auto / target-only, / best fixed k, / oracle; min and geomeans.
    With repetitions, a prompt's ratio is the median over repetitions of the ratio within one (the modes of a
    repetition run back to back), which a passing disturbance of one run does not move."""
    out = {}
    for m in result["modes"]:
        if m["k"] != "auto" and m["name"] != CONTROL:
            continue
        auto_name = m["name"]
        fixed = [x["name"] for x in result["modes"] if x["drafter"] == m["drafter"] and isinstance(x["k"], int)
                 and x["k"] > 0 and "@" in x["name"]] if m["name"] != CONTROL else []
        rows = []
        for r in result["records"]:
            modes = r["modes"]

            def rates(n):
                return modes[n].get("decode_rates") or [_decode_rate(modes[n]["stats"])]

            def ratio(a, b):
                pairs = [x / y for x, y in zip(rates(a), rates(b)) if y > 0]
                return _median(pairs) if pairs else 0.0

            if ratio(auto_name, "target_only") <= 0:
                continue
            row = {"id": r["id"], "category": r["category"], "auto_over_target_only": ratio(auto_name, "target_only"),
                   "k_steps": modes[auto_name]["stats"]["k_steps"]}
            if fixed:
                best = max(fixed, key=lambda n: _median(rates(n)))
                pays = _median(rates(best)) > _median(rates("target_only"))
                held_out = _held_out(rates, auto_name, fixed)
                if held_out is not None:
                    row["auto_over_best_fixed_held_out"] = held_out
                row.update(best_fixed=best, auto_over_best_fixed=ratio(auto_name, best),
                           auto_over_oracle=ratio(auto_name, best if pays else "target_only"), speculation_pays=pays,
                           fixed_over_target_only={n: ratio(n, "target_only") for n in fixed},
                           auto_over_fixed={n: ratio(auto_name, n) for n in fixed})
            rows.append(row)
        if not rows:
            continue
        worst = min(rows, key=lambda x: x["auto_over_target_only"])
        cell = {"rows": rows, "min_over_target_only": worst["auto_over_target_only"], "min_prompt": worst["id"],
                "geomean_over_target_only": geomean([x["auto_over_target_only"] for x in rows])}
        if fixed:
            pays = [x for x in rows if x["speculation_pays"]]
            if all("auto_over_best_fixed_held_out" in x for x in rows):
                cell["geomean_over_best_fixed_held_out"] = geomean([x["auto_over_best_fixed_held_out"] for x in rows])
            cell.update(geomean_over_best_fixed=geomean([x["auto_over_best_fixed"] for x in rows]),
                        geomean_over_oracle=geomean([x["auto_over_oracle"] for x in rows]),
                        geomean_over_best_fixed_where_it_pays=geomean([x["auto_over_best_fixed"] for x in pays]),
                        prompts_where_it_pays=len(pays))
            single = max(fixed, key=lambda n: geomean([x["fixed_over_target_only"][n] for x in rows]))
            cell.update(best_single_fixed=single,
                        geomean_over_best_single_fixed=geomean([x["auto_over_fixed"][single] for x in rows]))
        out[auto_name] = cell
    return out


def markdown(result: dict, summary: dict) -> str:
    cfg = result["config"]
    cats, table = summary["categories"], summary["table"]
    lines = ["# specexport bench", "",
             f"{len(result['records'])} prompts ({cfg['prompts']}), greedy, chat template, batch 1, "
             f"max_new_tokens={cfg['max_new_tokens']}, {result['threads']} threads, ONNX Runtime"
             f"{' (pre-packed)' if cfg['prepack'] else ''}; every mode on a prompt before the next (orders from a "
             "Williams design: each mode after every other equally often), warm-up excluded. "
             "tok/s: geometric mean, end to end (prefill included); x: over specexport target-only. "
             "Speculative rows: acceptance (accepted/drafted), a (acceptance MLE), tokens/step, and the decode "
             "speedup Leviathan's formula predicts from a and the measured step costs vs the measured one.", ""]
    lines += ["## tokens/s (x target-only)", "", "| mode | " + " | ".join(cats) + " | all |",
              "|---|" + "---|" * (len(cats) + 1)]
    for m in summary["modes"]:
        cells = [f"{table[c][m]['tokens_per_s']:.1f} ({table[c][m]['x_target_only']:.2f}x)" for c in cats + ["all"]]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += ["", "## speculative modes (all prompts)", "",
              "| mode | acceptance | a (MLE) | tokens/step | draft pass / target step | verify / target step | "
              "predicted | measured | measured/predicted | steps per k | acceptance at draft position 1..k | "
              "identical to reference |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in summary["modes"]:
        c = table["all"][m]
        if "predicted" in c:
            draft = f"{c['draft_pass_cost_ratio']:.2f}" if "draft_pass_cost_ratio" in c else "-"
            lines.append(f"| {m} | {c['acceptance']:.2f} | {c['acceptance_mle']:.2f} | {c['tokens_per_step']:.2f} | "
                         f"{draft} | {c['verify_cost_ratio']:.2f} | "
                         f"{c['predicted']:.2f}x | {c['measured']:.2f}x | {c['measured_over_predicted']:.2f} | "
                         f"{c['k_steps']} | {' '.join(f'{x:.2f}' for x in c.get('acceptance_per_pos', []))} | "
                         f"{c['identical']}/{c['n']} |")
    lines += ["", "## best speculative mode per category", "",
              "| category | best mode | x target-only | best transformers assisted mode | x that mode |",
              "|---|---|---|---|---|"]
    for c, b in summary["best"].items():
        lines.append(f"| {c} | {b['mode']} | {b['x_target_only']:.2f}x | {b.get('hf_best', '-')} | "
                     f"{b.get('x_hf_best', 0):.2f}x |")
    lines += ["", f"Best drafter per category, geometric mean over all prompts: "
                  f"{summary['best_per_category_geomean_x']:.2f}x specexport target-only.", ""]
    lines += _auto_lines(summary.get("auto", {}))
    same = {m: table["all"][m]["identical"] for m in summary["modes"]}
    n = len(result["records"])
    lines.append(f"Tokens identical to {result['reference']}: " +
                 ", ".join(f"{m} {v}/{n}" for m, v in same.items()))
    return "\n".join(lines) + "\n"


def _auto_lines(auto: dict) -> list[str]:
    if not auto:
        return []
    lines = ["## k=auto per prompt (decode rates, prefill excluded)", "",
             f"{CONTROL} is the A/A control: target-only against itself, the noise floor of these ratios.", "",
             "| auto mode | min auto / target-only (prompt) | geomean auto / target-only | geomean auto / best fixed k "
             "| ... held out | ... where speculation pays (prompts) | geomean auto / oracle "
             "| geomean auto / best single k |",
             "|---|---|---|---|---|---|---|---|"]
    for m, c in auto.items():
        if "geomean_over_best_fixed" in c:
            held = c.get("geomean_over_best_fixed_held_out")
            fixed = (f"{c['geomean_over_best_fixed']:.3f} | {'-' if held is None else f'{held:.3f}'} | "
                     f"{c['geomean_over_best_fixed_where_it_pays']:.3f} "
                     f"({c['prompts_where_it_pays']}) | {c['geomean_over_oracle']:.3f} | "
                     f"{c['geomean_over_best_single_fixed']:.3f} ({c['best_single_fixed'].split('@')[1]})")
        else:
            fixed = "- | - | - | - | -"
        lines.append(f"| {m} | {c['min_over_target_only']:.3f} ({c['min_prompt']}) | "
                     f"{c['geomean_over_target_only']:.3f} | {fixed} |")
    names = list(auto)
    lines += ["", "| prompt | category | " + " | ".join(f"{m} / target-only | / best fixed k" for m in names) + " |",
              "|---|---|" + "---|---|" * len(names)]
    by_id: dict = defaultdict(dict)
    for m in names:
        for row in auto[m]["rows"]:
            by_id[(row["id"], row["category"])][m] = row
    for (pid, cat), cells in by_id.items():
        parts = []
        for m in names:
            row = cells.get(m)
            parts.append("- | -" if row is None else f"{row['auto_over_target_only']:.2f} | " + (
                f"{row['auto_over_best_fixed']:.2f} ({row['best_fixed'].split('@')[1]})"
                if "best_fixed" in row else "-"))
        lines.append(f"| {pid} | {cat} | " + " | ".join(parts) + " |")
    return lines + [""]


def plots(result: dict, summary: dict, out: Path) -> list[str]:
    """speedup_vs_k.png (decode speedup per drafter: measured solid, predicted dashed, auto dotted),
    accept_hist.png and acceptance_per_pos.png."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    table = summary["table"]["all"]
    by_drafter: dict = defaultdict(list)
    for m in result["modes"]:
        if isinstance(m["k"], int) and "@" in m["name"] and not m["name"].endswith("]"):  # ([backend] rows: tok/s
            by_drafter[m["drafter"]].append((m["k"], m["name"]))  # only)
    files: list[str] = []

    def save(fig, ax, name: str, xlabel: str, ylabel: str, legend_size: int) -> None:  # -> out/name
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=legend_size)
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        files.append(name)

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (d, pts) in enumerate(sorted(by_drafter.items())):
        pts.sort()
        ks = [k for k, _ in pts]
        line, = ax.plot(ks, [table[n]["measured"] for _, n in pts], marker="o", label=f"{d} measured")
        ax.plot(ks, [table[n]["predicted"] for _, n in pts], ls="--", color=line.get_color(),
                label=f"{d} predicted (Leviathan)")
        auto = f"{d}@auto"
        if auto in table:
            ax.axhline(table[auto]["measured"], color=line.get_color(), ls=":", label=f"{d} auto, measured")
    ax.axhline(1.0, color="gray", lw=0.8)
    save(fig, ax, "speedup_vs_k.png", "k (draft tokens per step)", "decode speedup over target-only (geomean)", 7)

    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / max(1, len(by_drafter))
    for i, (d, pts) in enumerate(sorted(by_drafter.items())):
        k, name = max(pts)
        hist = [0] * (k + 1)
        for r in result["records"]:
            for j, n in enumerate(r["modes"][name]["stats"]["accept_hist"]):
                hist[j] += n
        total = sum(hist) or 1
        ax.bar([j + i * width for j in range(k + 1)], [h / total for h in hist], width, label=f"{name}")
    save(fig, ax, "accept_hist.png", "draft tokens accepted in a step", "share of steps", 7)

    fig, ax = plt.subplots(figsize=(6, 4))
    for m, c in table.items():
        per_pos = c.get("acceptance_per_pos")
        if per_pos:
            ax.plot(range(1, len(per_pos) + 1), per_pos, marker="o", label=m)
    ax.set_ylim(0, 1)
    save(fig, ax, "acceptance_per_pos.png", "draft position", "share of drafted tokens accepted there", 6)
    return files


def write_report(result: dict, out: str) -> dict:
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    summary = summarize(result)
    (folder / "bench.json").write_text(json.dumps({**result, "summary": summary}, indent=1))
    md = markdown(result, summary)
    (folder / "bench.md").write_text(md)
    files = ["bench.json", "bench.md"] + plots(result, summary, folder)
    return {"summary": summary, "markdown": md, "files": [str(folder / f) for f in files]}
