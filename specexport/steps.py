"""The three hot graphs as torch modules: prefill a chunk, draft k tokens, verify k drafts.

The torch backend runs these modules eagerly; export/ traces the very same modules into ONNX and TorchScript,
so every backend runs one definition of the step. Each forward takes and returns only tensors, in a fixed
order (`io_names` gives the names), with every layer's KV cache as an input and an output:

  prefill  tokens [B, C], past_len [B], last_index [B], key_pos [L], *kv -> logits [B, V], *kv
  draft    last_two [B, 2], past_len [B], key_pos [L], (sampling: temperature, top_k, top_p, greedy [B],
           u [B, k]), *kv -> draft [B, k], (sampling: q [B, k, V]), *kv
  verify   tokens [B, k+1] = [current, d1..dk], draft_len [B], past_len [B], key_pos [L], (sampling:
           temperature, top_k, top_p, greedy [B], u [B, k+1], q [B, k, V] when k > 0), *kv
           -> n_accepted [B], next [B], committed [B, k+1], *kv

kv is (key.0 .. key.{n-1}, value.0 .. value.{n-1}), each [B, Hkv, S, D]. key_pos is arange(L): attention reads
the first L cache positions (L >= max(past_len) + tokens; the engines pass S when shapes must be fixed).
verify with k = 0 is the target-only step; `verify_k0_exact` (fused set) is the same step whose attention runs
over the current token twice (positions past_len and past_len+1, the second row dropped) so that ONNX Runtime
uses its multi-row attention kernel, as in every verify pass (backends/ort_engine.py: exactness). The fused
graph set (ONNX Runtime's ops, models/ort_ops.py) has no fused k-pass draft graph: its draft runs one pass per
call, `draft_pass{W}`: tokens [B, W] (W = 1 or 2, the last W committed or drafted tokens, the last at past_len)
-> draft [B, 1] and, greedy, margin [B, 1] (its top logit minus the runner-up: how far the draft is from a tie) or,
sampling, q [B, 1, V]; KV written in place. The runtime ends a chain of passes after a near-tie (drafters.py:
ModelDrafter, the margin stop).
Greedy graphs take no sampling inputs; in sampling graphs, rows with greedy[b] take the greedy rule (their
temperature must be passed as 1).
The draft's tokens and q are in the target's vocabulary (a larger draft vocabulary is cut, a smaller one
padded with q = 0), so the verifier never sees the draft's own vocabulary size.
"""

from __future__ import annotations

import torch
from torch import nn

# the graphs' names and io contracts live in graphs.py (torch-free); re-exported for export/
from .graphs import SAMPLING_INPUTS, graph_list, graph_name, io_names, kv_names, tokens_per_pass  # noqa: F401
from .models import StaticKVDecoder
from .models.rescore import RescoredHead
from .verify import process_logits, sample_from, verify_greedy, verify_greedy_tokens, verify_sampling


class _Step(nn.Module):
    """Holds the model; `inplace` (eager and TorchScript) writes the caches in place, ONNX export does not;
    `static` (any export) always runs the top-k/top-p filter instead of deciding from the data."""

    def __init__(self, model: StaticKVDecoder, inplace: bool = True, static: bool = False):
        super().__init__()
        self.model = model
        self.n = model.cfg.num_layers
        self.vocab = model.cfg.vocab_size
        self.inplace, self.static = inplace, static

    def _filter(self) -> bool | str | None:
        """process_logits' filter: eager decides from the data; exports always run it, ONNX Runtime's graph set
        with its sort sized at run time (verify._SizedFilter)."""
        if not self.static:
            return None
        return "sized" if self.model.ops.startswith("fused") else True

    def _head_mode(self) -> None:
        """A rescored draft head rescores more candidates in a sampling step's passes (models/rescore.py)."""
        if isinstance(self.model.lm_head, RescoredHead):
            self.model.lm_head.sampling = bool(getattr(self, "sampling", False))

    def _run(self, tokens, past_len, key_pos, kv, logits_index=None, argmax: bool = False):
        self._head_mode()
        tokens = tokens.clamp(max=self.vocab - 1)  # ids past a smaller draft vocabulary: a stand-in token
        logits, keys, values = self.model.run(tokens, past_len, key_pos, kv[:self.n], kv[self.n:], logits_index,
                                              self.inplace, argmax)
        return logits, keys + values


class PrefillStep(_Step):
    def forward(self, tokens, past_len, last_index, key_pos, *kv):
        # tokens [B, C], past_len [B], last_index [B] (the chunk position whose logits are returned), key_pos [L]
        logits, kv = self._run(tokens, past_len, key_pos, kv, last_index)
        return (logits[:, 0], *kv)  # [B, V]


class DraftStep(_Step):
    """k draft-model passes fused: re-read the last two committed tokens, then feed each drafted token."""

    def __init__(self, model, k: int, sampling: bool, target_vocab: int, margin: bool = False, **kw):
        super().__init__(model, **kw)
        self.k, self.sampling, self.target_vocab = k, sampling, target_vocab
        self.margin = margin and not sampling  # greedy one-pass graphs: also each draft's logit margin [B, k]

    def _to_target_vocab(self, logits):  # [B, 1, Vd] -> [B, 1, Vt]
        vd, vt = logits.shape[-1], self.target_vocab
        if vd > vt:  # a padded tail beyond the target's vocabulary: never proposed
            return logits[..., :vt]
        if vd < vt:
            return torch.nn.functional.pad(logits, (0, vt - vd), value=float("-inf"))
        return logits

    def forward(self, last_two, past_len, key_pos, *rest):
        self._head_mode()  # (the portable passes below run the model directly)
        # last_two [B, W] at positions past_len-W+1 .. past_len (W = 2; a draft_pass graph also takes W = 1);
        # sampling: temperature, top_k, top_p, greedy [B], u [B, k]
        if self.sampling:
            temperature, top_k, top_p, greedy, u = rest[:5]
            kv = rest[5:]
        else:
            kv = rest
        B, W = last_two.shape[0], int(last_two.shape[1])
        tokens, pos = last_two, past_len - (W - 1)
        last = torch.full_like(past_len, W - 1)  # first pass: the logits after the last re-read token
        drafts, qs, margins = [], [], []
        pending = None
        # exported: the passes only read the caches, one write per layer at the end (fused: GroupQueryAttention
        # writes in place, one pass per graph)
        if not self.inplace and not self.model.ops.startswith("fused"):
            n = self.n
            L = key_pos.shape[0]
            prefix = [c[:, :, :L] for c in kv]  # [B, Hkv, L, D] each, sliced once for all k passes
            pending = (None, None)
        for i in range(self.k):
            if pending is None:
                logits, kv = self._run(tokens, pos, key_pos, kv, last)
            else:
                logits, pk, pv = self.model.run_pending(tokens.clamp(max=self.vocab - 1), past_len - 1, key_pos,
                                                        prefix[:n], prefix[n:], *pending, last)
                pending = (pk, pv)
            logits = self._to_target_vocab(logits)  # [B, 1, V]
            if self.margin:  # one TopK for the token and its margin (ties: the lower id first, as ArgMax)
                top2 = logits[:, 0].topk(2, -1)  # [B, 2]
                tok = top2.indices[:, 0]  # [B]
                margins.append(top2.values[:, 0] - top2.values[:, 1])  # [B]
            else:
                tok = logits[:, 0].argmax(-1)  # [B]
            if self.sampling:
                q = process_logits(logits, temperature, top_k, top_p, filter=self._filter())[:, 0]
                tok = torch.where(greedy, tok, sample_from(q, u[:, i]))
                qs.append(q)
            drafts.append(tok)
            pos = pos + tokens.shape[1]
            tokens, last = tok[:, None], torch.zeros_like(past_len)
        if pending is not None:  # the k+W-1 fed positions past_len-W+1 .. past_len+k-1, written once
            kv = _write_pending(kv, pending, past_len - (W - 1))
        out = [torch.stack(drafts, 1)]  # [B, k]
        if self.sampling:
            out.append(torch.stack(qs, 1))  # [B, k, V]
        if self.margin:
            out.append(torch.stack(margins, 1))  # [B, k]
        assert out[0].shape == (B, self.k)
        return (*out, *kv)


def _write_pending(kv, pending, start):
    """Scatter per-layer pending keys/values [B, Hkv, P, D] into the caches at positions start + arange(P)
    (out of place: ONNX Runtime binds each cache as input and output, so the write happens in place)."""
    pk, pv = pending
    S = int(kv[0].shape[2])
    Hkv, P, D = (int(d) for d in pk[0].shape[1:])
    pos = (start[:, None] + torch.arange(P)).clamp(max=S - 1)  # [B, P]
    idx = pos[:, None, :, None].expand(-1, Hkv, P, D)
    return [c.scatter(2, idx, p) for c, p in zip(kv, list(pk) + list(pv))]


class VerifyStep(_Step):
    """One target pass over [current, d1..dk] and the acceptance rule (verify.py) on its logits."""

    def __init__(self, model, k: int, sampling: bool, **kw):
        super().__init__(model, **kw)
        self.k, self.sampling = k, sampling

    def forward(self, tokens, draft_len, past_len, key_pos, *rest):
        k = self.k
        if not self.sampling:  # greedy: only the argmax (fused: the certified head's, models/certified.py)
            target, kv = self._run(tokens, past_len, key_pos, rest, argmax=True)  # [B, k+1]
            if k == 0:  # target-only
                return (torch.zeros_like(target[:, 0]), target[:, 0], target, *kv)
            return (*verify_greedy_tokens(target, tokens[:, 1:], draft_len), *kv)
        temperature, top_k, top_p, greedy, u = rest[:5]
        q = rest[5] if k > 0 else None
        kv = rest[6:] if k > 0 else rest[5:]
        logits, kv = self._run(tokens, past_len, key_pos, kv)  # [B, k+1, V]
        p = process_logits(logits, temperature, top_k, top_p, filter=self._filter())  # [B, k+1, V]
        if k == 0:  # target-only
            nxt = torch.where(greedy, logits[:, 0].argmax(-1), sample_from(p[:, 0], u[:, 0]))
            return (torch.zeros_like(nxt), nxt, nxt[:, None], *kv)
        draft = tokens[:, 1:]  # [B, k]
        g_acc, g_next, g_committed = verify_greedy(logits, draft, draft_len)
        n_acc, nxt, committed = verify_sampling(p, q, draft, draft_len, u[:, :k], u[:, k])
        return (torch.where(greedy, g_acc, n_acc), torch.where(greedy, g_next, nxt),
                torch.where(greedy[:, None], g_committed, committed), *kv)


def make_step(model: StaticKVDecoder, kind: str, k: int, sampling: bool, target_vocab: int, inplace: bool = True,
              static: bool = False) -> _Step:
    """The step module for a graph (eager: inplace, data-dependent filter; TorchScript: inplace, static;
    ONNX: out of place, static)."""
    kw = dict(inplace=inplace, static=static)
    if kind == "prefill":
        return PrefillStep(model, **kw)
    if kind == "draft":
        return DraftStep(model, k, sampling, target_vocab, **kw)
    if kind == "draft_pass":  # one pass (k = 1) over W = k tokens
        return DraftStep(model, 1, sampling, target_vocab, margin=True, **kw)
    if kind in ("verify", "verify_exact"):  # verify_exact: the model is traced with ops="fused_rows2"
        return VerifyStep(model, k, sampling, **kw)
    raise ValueError(kind)


def weight_tensors(model: StaticKVDecoder) -> dict[str, torch.Tensor]:
    """Every parameter and buffer once (tied weights appear once), named as the step modules see them:
    'model.' + name."""
    wrapper = PrefillStep(model)
    tensors = {n: t.detach() for n, t in wrapper.named_parameters()}
    tensors.update({n: t.detach() for n, t in wrapper.named_buffers()})
    return tensors
