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
                   top_p: torch.Tensor, filter: bool | None = None) -> torch.Tensor:
    """Temperature, then top-k, then top-p (the order transformers uses); returns probabilities.

    logits: [B, T, V] float; temperature: [B] float (> 0 here; greedy rows are handled by the callers);
    top_k: [B] long (0 = off); top_p: [B] float in (0, 1] (1 = off). returns probs [B, T, V] fp32.
    filter: None skips the top-k/top-p sort when no row asks for it (eager); True always runs it (traced graphs).
    """
    B, T, V = logits.shape
    assert temperature.shape == top_k.shape == top_p.shape == (B,)
    x = logits.float() / temperature.clamp_min(1e-6)[:, None, None]
    if filter is None:
        filter = bool((top_k > 0).any()) or bool((top_p < 1.0).any())
    if filter:
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
        x = x.masked_fill(x < threshold, float("-inf"))
    return x.softmax(-1)


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
