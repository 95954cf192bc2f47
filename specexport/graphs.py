"""The step graphs' names and input/output contracts (no torch: the runtime and engine_dir.py read these).

steps.py defines the graphs themselves; see its docstring for what each input and output holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import BuildConfig

SAMPLING_INPUTS = ("temperature", "top_k", "top_p", "greedy")


def kv_names(num_layers: int, suffix: str = "") -> list[str]:
    return [f"key{suffix}.{i}" for i in range(num_layers)] + [f"value{suffix}.{i}" for i in range(num_layers)]


def io_names(kind: str, k: int, sampling: bool, num_layers: int) -> tuple[list[str], list[str]]:
    """(input names, output names) of a step graph, in forward's order."""
    s_in = list(SAMPLING_INPUTS) + ["u"] if sampling else []
    if kind == "prefill":
        ins, outs = ["tokens", "past_len", "last_index", "key_pos"], ["logits"]
    elif kind == "draft":
        ins, outs = ["last_two", "past_len", "key_pos"] + s_in, ["draft"] + (["q"] if sampling else [])
    elif kind == "draft_pass":
        ins, outs = ["tokens", "past_len", "key_pos"] + s_in, ["draft", "q" if sampling else "margin"]
    elif kind in ("verify", "verify_exact"):
        ins = ["tokens", "draft_len", "past_len", "key_pos"] + s_in + (["q"] if sampling and k > 0 else [])
        outs = ["n_accepted", "next", "committed"]
    else:
        raise ValueError(kind)
    return ins + kv_names(num_layers), outs + kv_names(num_layers, "_out")


def tokens_per_pass(kind: str, k: int, chunk: int) -> int:
    """T, the static token width of a step graph (its `tokens` / `last_two` input is [B, T])."""
    return {"prefill": chunk, "draft": 2, "draft_pass": k, "verify": k + 1, "verify_exact": 1}[kind]


def graph_name(kind: str, k: int = 0, sampling: bool = False) -> str:
    """prefill, draft_k{k}_{mode}, verify_k{k}_{mode}, draft_pass{W}_{mode} (k is the width W there)."""
    mode = "sample" if sampling else "greedy"
    if kind == "prefill":
        return "prefill"
    if kind == "verify_exact":
        return f"verify_k0_exact_{mode}"
    return f"draft_pass{k}_{mode}" if kind == "draft_pass" else f"{kind}_k{k}_{mode}"


PER_ROW_MAX = 16  # per-row-attention variants exist for batches 2..16; a larger batch runs in chunks of 16


def rows_name(name: str, B: int) -> str:
    """The variant of graph `name` for exactly B rows with attention run per row (export/onnx_graphs.py:
    per_row_attention); its caches are `key.{layer}.{row}` [1, Hkv, S, D]."""
    return f"{name}_rows{B}"


def row_cache_name(name: str, row: int) -> str:
    """A per-row variant's cache input or output for one row: `key.{layer}` -> `key.{layer}.{row}`."""
    return f"{name}.{row}"


def graph_list(role: str, cfg: BuildConfig, ops: str | None = None,
               quantized: bool = False) -> list[tuple[str, str, int, bool]]:
    """(name, kind, k, sampling) of every graph a role gets (ops: the graph set, cfg.ops by default; a fused
    draft has one-pass graphs over 1 and 2 tokens instead of one k-pass graph per k). quantized: the role has
    quantized linears; a fused target then also gets `verify_k1` (2 rows) whether or not k = 1 is built, the
    exact target-only step on CPUs where a one-row MatMulNBits rounds differently (backends/row_probe.py), and
    there a step width like any built k (OrtEngine.free_ks: one draft token rides in it for nothing)."""
    modes = (False, True) if cfg.sampling else (False,)
    fused = (ops or cfg.ops) == "fused"
    if role == "target":
        kind, ks = "verify", (0, *cfg.ks)
    elif fused:
        kind, ks = "draft_pass", (1, 2)
    else:
        kind, ks = "draft", cfg.ks
    graphs = [("prefill", "prefill", 0, False)] + [(graph_name(kind, k, s), kind, k, s) for k in ks for s in modes]
    if role == "target" and fused:  # the exact batch-1 target-only step (steps.py, backends/ort_engine.py)
        graphs += [(graph_name("verify_exact", 0, s), "verify_exact", 0, s) for s in modes]
        if quantized and 1 not in ks:
            graphs += [(graph_name("verify", 1, s), "verify", 1, s) for s in modes]
    return graphs
