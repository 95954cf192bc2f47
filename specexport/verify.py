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
    sorted_p = (sorted_x - x.logsumexp(-1, keepdim=True)).exp()  # softmax, normalised over all V as in the graphs
    # the mass before each: the running sum itself (exclusive), not cumsum - p, which can round an ulp lower
    mass_before = torch.nn.functional.pad(sorted_p.cumsum(-1)[..., :-1], (1, 0))  # [B, T, V]
    # top_p == 1 keeps all (the float cumsum can reach 1.0 before the tail); the first token always stays
    keep_sorted = ((mass_before < top_p[:, None, None]) | (top_p >= 1.0)[:, None, None]
                   | (torch.arange(V, device=x.device) == 0))
    # the smallest kept logit is the threshold (ties with it are kept too)
    n_keep = keep_sorted.sum(-1, keepdim=True)  # [B, T, 1]
    threshold = sorted_x.gather(-1, n_keep - 1)
    return x.masked_fill(x < threshold, float("-inf"))


NUCLEUS = 1024  # logits the exported top-p filter sorts first; all V only where some row's nucleus is wider


class _SizedFilter(torch.autograd.Function):
    """`_filter` in an exported graph, its sort sized by the batch's settings at run time. A graph traced from
    `_filter` sorts all V logits of every row on every call, whether or not a row asks for top-k or top-p: on
    SmolLM2 (V = 49,152, 2 cores) 3 ms per row, 19 ms for a 12-row verify, as long as a draft pass.

    Here a TopK sorts the first K1 logits, K1 the largest top_k (capped at V) where a row has one, at least
    NUCLEUS where a row has top_p < 1, else 1. Where some row's nucleus does not end within those (their mass
    below its top_p), a second TopK sorts all V and that row's threshold comes from it; else that TopK sorts 1.
    Each threshold is `_filter`'s: a row without top-k (or top-p) gets -inf, which keeps every logit as
    `_filter`'s threshold at the smallest logit does, and a nucleus that ends within the first K logits has the
    same masses before each there as over all V (the same values, in the same order, over one normaliser; each the
    running sum itself, so "the nucleus ends within K" is exactly "the running sum past the K-th reaches top_p")."""

    @staticmethod
    def forward(ctx, x, top_k, top_p):
        return _filter(x, top_k, top_p)

    @staticmethod
    def symbolic(g, x, top_k, top_p):
        V = x.type().varyingSizes()[-1]  # (static: the vocabulary)
        const = lambda v, dtype=torch.int64: g.op("Constant", value_t=torch.tensor(v, dtype=dtype))  # noqa: E731
        last, rows_t, one = const([-1]), const([1, 2]), const([1])
        neg_inf, one_f = const(float("-inf"), torch.float32), const(1.0, torch.float32)
        k_max = g.op("Min", g.op("ReduceMax", top_k, keepdims_i=1), const([V]))  # [1]
        need_p = g.op("Less", g.op("ReduceMin", top_p, keepdims_i=1), one_f)  # [1]
        K1 = g.op("Max", g.op("Where", need_p, const([min(NUCLEUS, V)]), one),
                  g.op("Where", g.op("Greater", k_max, const([0])), k_max, one))
        sorted1, _ = g.op("TopK", x, K1, axis_i=-1, largest_i=1, sorted_i=1, outputs=2)  # [B, T, K1]
        tk = g.op("Unsqueeze", top_k, rows_t)  # [B, 1, 1]
        tp = g.op("Unsqueeze", top_p, rows_t)
        lead = g.op("Slice", g.op("Shape", sorted1), const([0]), const([2]))  # [B, T]
        at = lambda i: g.op("Expand", i, g.op("Concat", lead, one, axis_i=0))  # noqa: E731  [B, T, 1]
        # top-k: the k-th largest (k <= K1 wherever a row has one)
        kth = g.op("Where", g.op("Greater", tk, const([0])),
                   g.op("GatherElements", sorted1, at(g.op("Sub", g.op("Min", tk, K1), one)), axis_i=-1), neg_inf)
        cut = lambda v: g.op("Where", g.op("Less", v, kth), neg_inf, v)  # noqa: E731
        x = cut(x)
        lse = g.op("ReduceLogSumExp", x, last, keepdims_i=1)  # [B, T, 1]: over all V, after top-k

        def nucleus(sorted_x, K):  # -> the smallest kept logit [B, T, 1], the mass of the K sorted [B, T, 1]
            p = g.op("Exp", g.op("Sub", sorted_x, lse))
            before = g.op("CumSum", p, const(-1), exclusive_i=1)  # the running sum before each
            first = g.op("Equal", g.op("Range", const(0), g.op("Squeeze", K, const([0])), const(1)), const(0))
            keep = g.op("Or", g.op("Or", g.op("Less", before, tp), g.op("GreaterOrEqual", tp, one_f)), first)
            n_keep = g.op("ReduceSum", g.op("Cast", keep, to_i=7), last, keepdims_i=1)  # [B, T, 1] (int64)
            # the running sum past the K-th: what a full sort's next `before` is, the same addition
            at_end = lambda v: g.op("Slice", v, last, const([V + 1]), last)  # noqa: E731  [B, T, 1]: the K-th
            end = g.op("Add", at_end(before), at_end(p))
            return g.op("GatherElements", sorted_x, g.op("Sub", n_keep, one), axis_i=-1), end

        threshold1, mass1 = nucleus(cut(sorted1), K1)
        ended = g.op("Or", g.op("GreaterOrEqual", mass1, tp), g.op("GreaterOrEqual", tp, one_f))  # [B, T, 1]
        ok = g.op("Cast", g.op("Reshape", g.op("ReduceMin", g.op("Cast", ended, to_i=7), keepdims_i=1), one),
                  to_i=9)  # [1]: bool
        K2 = g.op("Where", ok, one, const([V]))
        sorted2, _ = g.op("TopK", x, K2, axis_i=-1, largest_i=1, sorted_i=1, outputs=2)
        threshold2, _ = nucleus(sorted2, K2)
        threshold = g.op("Where", g.op("Less", tp, one_f), g.op("Where", ok, threshold1, threshold2), neg_inf)
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
