"""The acceptance rule, as pure torch functions (the same code runs eagerly and inside exported graphs).

Words (Leviathan et al. 2023), defined once for the whole project:
  p          the target's next-token distribution after sampling processing (temperature, top-k, top-p).
  q          the draft's distribution after the same processing. A drafter with no distribution
             (prompt lookup / n-gram) counts as one-hot q at its proposed token.
  accepted   draft tokens that survive: draft token x at position i is accepted with prob min(1, p(x)/q(x)),
             and only while every earlier draft token was accepted.
  recovered  on the first rejection (position n), one token drawn from norm(max(p_n - q_n, 0)).
  bonus      if all k are accepted, one token drawn from p at position k+1.
  committed  every step commits n_accepted + 1 tokens: the accepted drafts, then the recovered or bonus token.
  greedy     the limit case (temperature 0): p and q are one-hot at their argmax, so drafts are accepted
             while argmax p == draft token, and the next token is argmax p.

Randomness comes in as uniforms in [0, 1) drawn by the caller from a per-request seed, so the same seed
gives the same tokens on every backend. Sampling from a distribution is inverse-CDF with one uniform.
Shapes: B rows, k draft tokens, V vocabulary. Outputs are fixed-size and padded with -1.
"""

from __future__ import annotations

import torch


def process_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, filter: bool | str | None = None) -> torch.Tensor:
    """Temperature, then top-k, then top-p (the order transformers uses); returns probabilities.

    logits: [B, T, V] float; temperature: [B] float (> 0 here; greedy rows are handled by the callers);
    top_k: [B] long (0 = off); top_p: [B] float in (0, 1] (1 = off). returns probs [B, T, V] fp32.
    filter: None skips the top-k/top-p sort when no row asks for it (eager); True always runs it (traced graphs);
    "sized" (ONNX Runtime's graphs) exports the filter with its sort sized at run time (`_SizedFilter`).
    """
    B, T, V = logits.shape
    assert temperature.shape == top_k.shape == top_p.shape == (B,)
    x = logits.float() / temperature.clamp_min(1e-6)[:, None, None]
    if filter is None:
        filter = bool((top_k > 0).any()) or bool((top_p < 1.0).any())
    if filter == "sized" and torch.onnx.is_in_onnx_export():
        x = _SizedFilter.apply(x, top_k, top_p)
    elif filter:
        x = _filter(x, top_k, top_p)
    return x.softmax(-1)


def _filter(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """x [B, T, V] with the logits below each row's top-k and top-p thresholds set to -inf."""
    B, T, V = x.shape
    sorted_x, _ = x.sort(dim=-1, descending=True)  # [B, T, V]
    # top-k: keep logits >= the k-th largest (ties kept, as transformers does)
    kk = torch.where(top_k > 0, top_k, torch.full_like(top_k, V)).clamp(max=V)
    kth = sorted_x.gather(-1, (kk - 1)[:, None, None].expand(B, T, 1))  # [B, T, 1]
    x = x.masked_fill(x < kth, float("-inf"))
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    # top-p: keep the smallest head of the sorted distribution whose mass reaches top_p
    sorted_p = sorted_x.softmax(-1)
    mass_before = sorted_p.cumsum(-1) - sorted_p  # [B, T, V]
    # top_p == 1 keeps all (the float cumsum can reach 1.0 before the tail); the first token always stays
    keep_sorted = ((mass_before < top_p[:, None, None]) | (top_p >= 1.0)[:, None, None]
                   | (torch.arange(V, device=x.device) == 0))
    # the smallest kept logit is the threshold (ties with it are kept too)
    n_keep = keep_sorted.sum(-1, keepdim=True)  # [B, T, 1]
    threshold = sorted_x.gather(-1, n_keep - 1)
    return x.masked_fill(x < threshold, float("-inf"))


class _SizedFilter(torch.autograd.Function):
    """`_filter` in an exported graph, its sort sized by the batch's settings at run time: K = V where some row
    has top_p < 1, else the largest top_k (capped at V) where some row has one, else 1. A graph traced from
    `_filter` sorts all V logits of every row on every call, what top-k and top-p need, whether or not a row
    asks for them: on SmolLM2 (V = 49,152) that sort took 4 ms per row on 2 cores, as long as a draft pass.

    The thresholds are `_filter`'s, read from the first K sorted logits: a row without top-k (or top-p) gets
    -inf in place of its threshold, which keeps every logit, as `_filter`'s threshold at the smallest logit
    does; where K = V every node computes what `_filter`'s graph does, so the probabilities are the same."""

    @staticmethod
    def forward(ctx, x, top_k, top_p):
        return _filter(x, top_k, top_p)

    @staticmethod
    def symbolic(g, x, top_k, top_p):
        V = x.type().varyingSizes()[-1]  # (static: the vocabulary)
        const = lambda v, dtype=torch.int64: g.op("Constant", value_t=torch.tensor(v, dtype=dtype))  # noqa: E731
        last, rows_t = const([-1]), const([1, 2])
        neg_inf, one_f = const(float("-inf"), torch.float32), const(1.0, torch.float32)
        # K [1]: V if any row has top_p < 1, else min(max top_k, V) if any has top_k > 0, else 1
        k_max = g.op("Min", g.op("ReduceMax", top_k, keepdims_i=1), const([V]))
        need_p = g.op("Less", g.op("ReduceMin", top_p, keepdims_i=1), one_f)
        need_k = g.op("Greater", k_max, const([0]))
        K = g.op("Where", need_p, const([V]), g.op("Where", need_k, k_max, const([1])))
        sorted_x, _ = g.op("TopK", x, K, axis_i=-1, largest_i=1, sorted_i=1, outputs=2)  # [B, T, K]
        tk = g.op("Unsqueeze", top_k, rows_t)  # [B, 1, 1]
        tp = g.op("Unsqueeze", top_p, rows_t)
        lead = g.op("Slice", g.op("Shape", sorted_x), const([0]), const([2]))  # [B, T]
        at = lambda i: g.op("Expand", i, g.op("Concat", lead, const([1]), axis_i=0))  # noqa: E731  [B, T, 1]
        # top-k: the k-th largest (k <= K wherever a row has one)
        k_idx = g.op("Sub", g.op("Min", tk, K), const([1]))
        kth = g.op("Where", g.op("Greater", tk, const([0])), g.op("GatherElements", sorted_x, at(k_idx), axis_i=-1),
                   neg_inf)  # [B, T, 1]
        x = g.op("Where", g.op("Less", x, kth), neg_inf, x)
        sorted_x = g.op("Where", g.op("Less", sorted_x, kth), neg_inf, sorted_x)
        # top-p (only where K = V): the smallest kept logit of the head whose mass reaches top_p
        sorted_p = g.op("Softmax", sorted_x, axis_i=-1)
        mass_before = g.op("Sub", g.op("CumSum", sorted_p, const(-1)), sorted_p)
        first = g.op("Equal", g.op("Range", const(0), g.op("Squeeze", K, const([0])), const(1)), const(0))  # [K]
        keep = g.op("Or", g.op("Or", g.op("Less", mass_before, tp), g.op("GreaterOrEqual", tp, one_f)), first)
        n_keep = g.op("ReduceSum", g.op("Cast", keep, to_i=7), last, keepdims_i=1)  # [B, T, 1] (int64)
        threshold = g.op("Where", g.op("Less", tp, one_f),
                         g.op("GatherElements", sorted_x, g.op("Sub", n_keep, const([1])), axis_i=-1), neg_inf)
        y = g.op("Where", g.op("Less", x, threshold), neg_inf, x)
        y.setType(x.type())
        return y


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling. probs: [..., V] (unnormalised is fine); u: [...] in [0, 1). returns [...] long."""
    cdf = probs.cumsum(-1)
    x = u * cdf[..., -1]
    return (cdf <= x[..., None]).sum(-1).clamp(max=probs.shape[-1] - 1)


def verify_greedy(p_logits: torch.Tensor, draft: torch.Tensor, draft_len: torch.Tensor):
    """Greedy acceptance.

    p_logits: [B, k+1, V] target logits over [current, d1..dk]; draft: [B, k] long;
    draft_len: [B] long, how many of the k drafts are real (the rest are padding, never accepted).
    returns n_accepted [B], next_token [B], committed [B, k+1] (-1 padded).
    """
    return verify_greedy_tokens(p_logits.argmax(-1), draft, draft_len)


def verify_greedy_tokens(target: torch.Tensor, draft: torch.Tensor, draft_len: torch.Tensor):
    """verify_greedy over the target's argmax tokens [B, k+1] (a greedy graph's certified head gives only those)."""
    B, T = target.shape
    k = T - 1
    assert draft.shape == (B, k) and draft_len.shape == (B,)
    valid = torch.arange(k, device=draft.device)[None] < draft_len[:, None]  # [B, k]
    match = (target[:, :k] == draft) & valid
    n_accepted = _leading_true(match)  # [B]
    next_token = target.gather(1, n_accepted[:, None])[:, 0]
    return n_accepted, next_token, _committed(draft, n_accepted, next_token)


def verify_sampling(p: torch.Tensor, q: torch.Tensor | None, draft: torch.Tensor, draft_len: torch.Tensor,
                    u_accept: torch.Tensor, u_next: torch.Tensor):
    """Rejection sampling (Leviathan et al. 2023, Algorithm 1), exact in distribution.

    p: [B, k+1, V] processed target probs; q: [B, k, V] processed draft probs, or None for one-hot drafts;
    draft: [B, k] long; draft_len: [B] long (padding positions count as q = 0, so they are never accepted
    and the token drawn there comes from p); u_accept: [B, k]; u_next: [B] uniforms in [0, 1).
    returns n_accepted [B], next_token [B], committed [B, k+1] (-1 padded).
    """
    B, T, V = p.shape
    k = T - 1
    assert draft.shape == (B, k) and draft_len.shape == (B,) and u_accept.shape == (B, k) and u_next.shape == (B,)
    valid = torch.arange(k, device=draft.device)[None] < draft_len[:, None]  # [B, k]
    p_draft = p[:, :k].gather(-1, draft[..., None])[..., 0]  # [B, k]: p(d_i)
    if q is None:
        q_full = torch.nn.functional.one_hot(draft, V).to(p.dtype)  # [B, k, V]
    else:
        assert q.shape == (B, k, V), f"q must be [B, k, V]={(B, k, V)}, got {tuple(q.shape)}"
        q_full = q
    q_full = q_full * valid[..., None]
    q_draft = q_full.gather(-1, draft[..., None])[..., 0]  # [B, k]: q(d_i), 0 on padding
    accept = (u_accept * q_draft < p_draft) & valid  # u < p/q without dividing
    n_accepted = _leading_true(accept)  # [B]
    # residual at the first rejection; at n == k q is zero (bonus), so residual = p
    q_pad = torch.cat([q_full, torch.zeros_like(p[:, :1])], dim=1)  # [B, k+1, V]
    idx = n_accepted[:, None, None].expand(B, 1, V)
    p_n = p.gather(1, idx)[:, 0]  # [B, V]
    residual = (p_n - q_pad.gather(1, idx)[:, 0]).clamp_min(0)
    # p == q exactly gives an all-zero residual; then rejection had probability 0, so fall back to p
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, p_n, residual)
    next_token = sample_from(residual, u_next)
    return n_accepted, next_token, _committed(draft, n_accepted, next_token)


def _leading_true(x: torch.Tensor) -> torch.Tensor:
    """[B, k] bool -> [B] long: how many leading entries are True (cumsum form: ONNX has no CumProd)."""
    return ((~x).long().cumsum(-1) == 0).long().sum(-1)


def _committed(draft: torch.Tensor, n_accepted: torch.Tensor, next_token: torch.Tensor) -> torch.Tensor:
    """[B, k+1]: d[:n_accepted], next, then -1."""
    B, k = draft.shape
    pos = torch.arange(k + 1, device=draft.device)[None]  # [1, k+1]
    padded = torch.cat([draft, torch.full_like(draft[:, :1], -1)], dim=1)
    out = torch.where(pos < n_accepted[:, None], padded, torch.full_like(padded, -1))
    return torch.where(pos == n_accepted[:, None], next_token[:, None], out)
