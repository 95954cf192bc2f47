"""The batch of cache rows the runtime steps: each row holds one request at its own position.

`Batch.admit` prefills requests into free rows; `Batch.step` is the hot loop and reads top to bottom: draft,
verify, commit, advance. Only the committed tokens cross to the host (one `.tolist()` per step). The host
state is numpy; each request's uniforms come from its own numpy stream (sampling.row_stream).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from .autok import RowState
from .drafters import DraftInputs, HybridDrafter, Proposal
from .request import GenerationStats, Request
from .sampling import SamplingRows, process_logits, row_stream, sample_from

if TYPE_CHECKING:
    from .runtime import SpeculativeDecoder


class Batch:
    """The engines' cache rows, each holding one request at its own position.

    Requests join with `admit` (prefilled in their own rows) and leave when they finish, both at step
    boundaries; `step` is the hot loop: draft, verify, commit, advance over rows 0..hi-1, where hi is one past
    the highest occupied row (a free row in between computes padding that nothing reads). Only the committed
    tokens cross to the host (one `.tolist()` per step). k is fixed, or "auto" (specexport/autok) chosen per step.
    """

    def __init__(self, dec: SpeculativeDecoder, speculative: bool, k: int | str):
        cfg = dec.config
        W = cfg.max_batch
        self.dec, self.C = dec, cfg.prefill_chunk
        self.speculative = speculative and dec.drafter is not None
        self.auto = dec.autok() if k == "auto" and self.speculative else None
        self.ks = dec.built_ks()  # the verify widths a step may run (the engine's, + its free ones)
        self.k = k if isinstance(k, int) else max(self.ks)  # the largest k a step may use
        self.k_label = k
        self.reqs: list[Request | None] = [None] * W
        self.gens: list[np.random.Generator | None] = [None] * W
        self.acc = [RowState() for _ in range(W)]  # per row: acceptance per proposal source (auto k)
        self.history = np.zeros((W, cfg.max_seq_len), dtype=np.int64)  # [W, max_seq_len] committed tokens
        self.lengths = [0] * W  # valid history per row (the current token included)
        # [W]: the current token's position; a free row sits at 1, so its padding passes (the draft re-reads
        # position past_len - 1) stay inside its own cache row and attend at least one finite position
        self.past_len = np.ones(W, dtype=np.int64)
        # [W]: positions < draft_valid hold the draft model's KV of committed tokens, or the target's where a
        # quantized copy takes them from it (it lags after target-only steps, and catches up before its next draft;
        # unused where the draft runs over the target's cache: it never lags, drafters.ModelDrafter.link_kv)
        self.draft_valid = [0] * W
        self._admitting: set[int] = set()  # rows of the admit() call in progress (not yet running)
        self.prev = np.zeros(W, dtype=np.int64)  # [W]: the token before the current one
        self.current = np.zeros(W, dtype=np.int64)  # [W]: the last committed token, not yet in any cache
        self.temperature = np.ones(W, dtype=np.float32)  # [W] sampling parameters per row (free and greedy rows: 1)
        self.top_k = np.zeros(W, dtype=np.int64)
        self.top_p = np.ones(W, dtype=np.float32)
        self.greedy = np.ones(W, dtype=bool)

    def rows(self) -> list[int]:
        return [b for b, r in enumerate(self.reqs) if r is not None]

    def free_rows(self) -> list[int]:
        return [b for b, r in enumerate(self.reqs) if r is None]

    def _sampling(self, rows: list[int], B: int) -> SamplingRows | None:
        if all(self.reqs[b].sampling.greedy for b in rows):
            return None
        return SamplingRows(self.temperature[:B], self.top_k[:B], self.top_p[:B], self.greedy[:B])

    def _uniforms(self, rows: list[int], B: int, n: int, sampling) -> np.ndarray:  # [B, n], per-row streams
        u = np.zeros((B, n), dtype=np.float32)
        if sampling is not None:  # greedy reads no randomness
            for b in rows:
                u[b] = self.gens[b].random(n, dtype=np.float32)
        return u

    def _release(self, b: int) -> None:
        self.reqs[b] = self.gens[b] = None
        self.lengths[b] = 0
        self.past_len[b] = 1
        self.temperature[b], self.top_k[b], self.top_p[b], self.greedy[b] = 1.0, 0, 1.0, True

    def admit(self, rows: list[int], reqs: list[Request]) -> list[tuple[Request, list[int]]]:
        """Prefill each request in its row (contiguous rows together) and commit its first token."""
        assert len(rows) == len(reqs) and all(self.reqs[b] is None for b in rows)
        for b, r in zip(rows, reqs):
            n = len(r.ids)
            self.reqs[b], self.gens[b] = r, row_stream(r.sampling.seed)
            self.acc[b] = RowState()
            self.history[b, :n] = r.ids
            self.lengths[b] = n
            sp = r.sampling
            if sp.greedy:  # neutral filters: a greedy row never makes the others run the top-k/top-p sort
                self.temperature[b], self.top_k[b], self.top_p[b], self.greedy[b] = 1.0, 0, 1.0, True
            else:
                self.temperature[b], self.top_k[b], self.top_p[b], self.greedy[b] = \
                    sp.temperature, sp.top_k, sp.top_p, False
            r.stats = GenerationStats(k=self.k_label if self.speculative else 0, prompt_tokens=n,
                                      accept_hist=[0] * (self.k + 1), proposed_hist=[0] * (self.k + 1))
        events = []
        self._admitting = set(rows)
        for run in _contiguous(sorted(rows)):
            events += self._prefill(run)
        self._admitting = set()
        return events

    def _prefill(self, run: list[int]) -> list[tuple[Request, list[int]]]:
        # Prompts in chunks of C (padded to C for fixed-shape engines: padding writes only beyond a row's end,
        # where nothing reads it), both models, rows run[0].. of the caches.
        dec, C, row0, B = self.dec, self.C, run[0], len(run)
        t0 = time.perf_counter()
        lengths = [self.lengths[b] for b in run]
        # the draft model sees the prompt now, unless auto has it off, for this request or for the batch it joins
        # (then it catches up if drafting turns on)
        others = [b for b in self.rows() if b not in self._admitting]
        draft_too = self.speculative and (self.auto is None or self.auto.expects_drafting(
            self.rows()[-1] + 1, self._draft_lag(others) if others else 0))
        # copied after the target's (nothing to do where the draft runs over the target's cache)
        seed = draft_too and getattr(dec.drafter, "kv_source", None) is not None
        last_logits = np.empty((B, dec.target.vocab_size), dtype=np.float32)  # [B, V] at each prompt's last token
        for start in range(0, max(lengths), C):
            chunk = self._chunk(run, [start] * B)  # [B, C] (or fewer, eager)
            past = np.full(B, start, dtype=np.int64)
            last = np.array([min(max(n - 1 - start, 0), chunk.shape[1] - 1) for n in lengths], dtype=np.int64)
            kv_len = min(start + chunk.shape[1], dec.config.cache_len)
            logits = dec.target.prefill(chunk, past, last, kv_len, row0)  # [B, V]
            ends_here = np.array([start <= n - 1 < start + C for n in lengths])
            last_logits[ends_here] = logits[ends_here]
            if draft_too and not seed:
                t = time.perf_counter()
                dec.drafter.prefill(chunk, past, kv_len, row0)
                if self.auto is not None:  # what a catch-up through a prefill chunk costs
                    self.auto.observe_chunk(B, time.perf_counter() - t)
        if seed:  # the prompt's keys and values: the target's (drafters.ModelDrafter.link_kv)
            dec.drafter.seed(run, [0] * B, lengths)
        # the first token, from the prefill logits, with each row's own sampling
        sampling = self._sampling(run, row0 + B)
        u = self._uniforms(run, row0 + B, 1, sampling)[row0:, 0]  # [B]
        first = last_logits.argmax(-1)  # [B]
        if sampling is not None:
            sel = slice(row0, row0 + B)
            probs = process_logits(last_logits, self.temperature[sel], self.top_k[sel], self.top_p[sel])  # [B, V]
            first = np.where(self.greedy[sel], first, sample_from(probs, u))
        first = first.tolist()
        prefill_s = time.perf_counter() - t0
        events = []
        for b, tok in zip(run, first):
            r = self.reqs[b]
            r.stats.prefill_s = prefill_s
            self.past_len[b] = self.lengths[b]
            self.draft_valid[b] = self.lengths[b] if draft_too else 0
            self.prev[b] = r.ids[-1]
            self.current[b] = tok
            self.history[b, self.lengths[b]] = tok
            self.lengths[b] += 1
            events.append((r, r.commit([tok])))
            if r.finish_reason is not None:
                self._release(b)
        return events

    def _chunk(self, run: list[int], starts: list[int]) -> np.ndarray:
        """[B, C] history tokens of rows `run` from each row's start (zero padded; eager: cut to what is needed)."""
        C = self.C
        chunk = np.zeros((len(run), C), dtype=np.int64)
        for i, (b, s) in enumerate(zip(run, starts)):
            part = self.history[b, s:min(s + C, self.history.shape[1])]
            chunk[i, :len(part)] = part
        if not self.dec.target.fixed_shapes:
            chunk = chunk[:, :max(1, max(self.lengths[b] - s for b, s in zip(run, starts)))]
        return chunk

    def _catch_up_draft(self, rows: list[int], B: int) -> tuple[int, str]:
        """After target-only steps a draft model has not seen the latest committed tokens: show it them (rows
        0..B-1 together), by the cheaper way for the largest gap (autok.catch_up): draft calls that rewrite two
        committed tokens each, or prefill chunks. Rows already up to date rewrite their last committed tokens
        (identical KV). A quantized copy of the target whose cache mirrors the target's copies the rows' missing
        positions from the target's cache instead, and one that runs over the target's cache never lags
        (drafters.ModelDrafter.link_kv). -> (calls, "pass" | "chunk"), or (row-positions copied, "copy")."""
        dec = self.dec
        gap = self._draft_lag(rows)
        if not gap:
            return 0, "pass"
        need, calls = [b for b in rows if self.draft_valid[b] < self.lengths[b] - 2], 0
        if getattr(dec.drafter, "kv_source", None) is not None:  # copied from the target's cache
            starts, ends = [self.draft_valid[b] for b in need], [self.lengths[b] - 2 for b in need]
            dec.drafter.seed(need, starts, ends)
            for b, end in zip(need, ends):
                self.draft_valid[b] = end
            return max(sum(ends) - sum(starts), 1), "copy"  # costed per row-position copied (autok.catch_up)
        by = (self.auto or dec.autok()).catch_up(gap, B)[1]  # (a fixed k: unmeasured, decided in draft passes)
        while need:
            starts = [min(self.draft_valid[b], self.lengths[b] - 2) if self.reqs[b] is not None else 0
                      for b in range(B)]
            if by == "pass":  # positions s, s+1 of each row
                pairs = np.stack([self.history[np.arange(B), starts], self.history[np.arange(B), np.add(starts, 1)]], 1)
                dec.drafter.rewrite(pairs, np.add(starts, 1), dec.config.cache_len)
                width = 2
            else:
                chunk = self._chunk(list(range(B)), starts)
                dec.drafter.prefill(chunk, np.array(starts, dtype=np.int64),
                                    min(max(starts) + chunk.shape[1], dec.config.cache_len), 0)
                width = chunk.shape[1]
            calls += 1
            for b in need:
                self.draft_valid[b] = min(starts[b] + width, self.lengths[b] - 2)
            need = [b for b in need if self.draft_valid[b] < self.lengths[b] - 2]
        return calls, by

    def _draft_lag(self, rows: list[int]) -> int:
        """The most committed tokens a row's draft model has not seen (rows catch up together; none where the
        draft's cache is the target's: drafters.ModelDrafter.link_kv)."""
        if getattr(self.dec.drafter, "shares_kv", False):
            return 0
        return max(max(self.lengths[b] - 2 - self.draft_valid[b], 0) for b in rows)

    def _hybrid_lookup(self, d: HybridDrafter, rows: list[int], B: int, last_two: np.ndarray):
        """Lookup's proposal for every row at the largest k, which rows take it (free rows: padding), and with
        auto the free step's width where every row matched (autok.free_width: None, the model drafts instead
        and no row takes lookup; -1, `width` chooses; else verified whole at that width)."""
        x = DraftInputs(last_two, self.past_len[:B], 0, self.history[:B], self.lengths[:B], None, None)
        lk, use = d.lookups(x, self.k)
        use = [take or self.reqs[b] is None for b, take in enumerate(use)]
        whole = -1
        if all(use) and self.auto is not None:
            lens = lk.draft_len.tolist()
            whole = self.auto.free_width(B, [self.acc[b] for b in rows], [lens[b] for b in rows],
                                         [lk.source[b] for b in rows], self._draft_lag(rows))
            if whole is None:
                use, whole = [self.reqs[b] is None for b in range(B)], -1
        return lk, use, whole

    def _plan_k(self, rows: list[int], B: int, free: bool = False) -> int:
        """The k to draft this step (0: a target-only step). free: every row has a free (lookup) proposal."""
        if not self.speculative:
            return 0
        if self.auto is None:
            return self.k
        free = free or self.auto.free_drafts
        return self.auto.plan(B, [self.acc[b] for b in rows], 0 if free else self._draft_lag(rows), free)

    def _trim_handover(self, rows, draft: np.ndarray, draft_len: np.ndarray, source: list[int], handover: list,
                       passes: int, B: int):
        """A model step whose chain handed rows over to lookup: verify lookup's rest only as far as it pays
        (AutoK.handover_width; only one-hot lookup tokens are cut, never the model's) -> (draft_len, longest,
        handover, cut): rows cut to the width; cut[b] = (row b's first cut token, its lookup source) or None,
        checked against the target's token if the verify accepts everything before it (a shadow check)."""
        lens = draft_len.tolist()
        if all(h is None for h in handover):
            return draft_len, max(lens), handover, None
        heads = [h[0] if h is not None else 0 if source[b] else lens[b] for b, h in enumerate(handover)]
        srcs = [h[1] if h is not None else source[b] for b, h in enumerate(handover)]
        j = self.auto.handover_width(B, [self.acc[b] for b in rows], [heads[b] for b in rows],
                                     [lens[b] for b in rows], [srcs[b] for b in rows], passes)
        cut = [(int(draft[b, j]), srcs[b]) if lens[b] > j else None for b in range(B)]
        draft_len = np.minimum(draft_len, j)
        return draft_len, int(draft_len.max()), [None if h is None or draft_len[b] <= h[0] else h
                                                 for b, h in enumerate(handover)], cut

    def _verify_k(self, longest: int, k: int) -> int:
        """The verify width for drafts of at most `longest` tokens: fixed-shape engines take the smallest
        built k that holds them (a prompt-lookup step with 2 proposals runs verify_k2, not verify_k8)."""
        if longest == 0:
            return 0
        if not self.dec.target.fixed_shapes:
            return longest
        return min(kk for kk in self.ks if kk >= longest)

    def step(self) -> list[tuple[Request, list[int]]]:
        """One speculative (or target-only) step for every occupied row; returns [(request, taken tokens)]."""
        dec = self.dec
        rows = self.rows()
        if not rows:
            return []
        B = rows[-1] + 1
        t0 = time.perf_counter()
        d = dec.drafter
        sampling = self._sampling(rows, B)
        past_len, current = self.past_len[:B], self.current[:B]
        past_max = max(self.lengths[b] - 1 for b in rows)  # == max(past_len), known on the host without a sync
        last_two = np.stack([self.prev[:B], current], 1)  # [B, 2]
        lk = use = None
        whole = -1  # a free step's width where lookup's matches are verified whole (-1: `width` chooses)
        if self.speculative and isinstance(d, HybridDrafter):  # lookup first: it costs no pass
            lk, use, whole = self._hybrid_lookup(d, rows, B, last_two)
        free = lk is not None and all(use)  # every row takes lookup's proposal: the draft model does not run
        k = self._plan_k(rows, B, free)  # 0: a target-only step
        if not k and lk is not None and self.auto is not None and lk.longest and not self.auto.refreshing and \
                self.auto.verify_cost(0, B) is not None:
            # the model does not pay at this step (under load: a verify over B x (k+1) rows is compute-bound),
            # but lookup's proposals cost nothing: a prompt-lookup step, ragged, whose width `width` chooses (0:
            # target-only), over every row's match as prompt lookup alone makes it (min_match only chooses
            # between lookup and the model; `cap` and the per-source acceptance limit short matches). Before, the
            # hybrid under load ran target-only steps where prompt lookup alone verified its matches (16 clients:
            # 0.975x against 1.065x). Not when auto re-measures c(0) (its target-only step must run).
            free, k = True, max(self.auto.ks)
        catch_up_s, catch_up_calls, catch_up_by = 0.0, 0, "pass"
        if k and not free and getattr(d, "engine", None) is not None:  # a draft model: KV up to date first
            t = time.perf_counter()
            catch_up_calls, catch_up_by = self._catch_up_draft(rows, B)
            catch_up_s = time.perf_counter() - t
        # 1. Draft: d [B, k], q [B, k, V] or None, draft_len [B].
        u = self._uniforms(rows, B, 2 * k + 1, sampling)  # [B, 2k+1]: draft | accept | next
        longest, shadow, source, model_ran, unused, passes, handover, cut = 0, None, [0] * B, False, None, 0, None, None
        tied = None  # [B]: a model row's chain ended at a near-tie (autok.AutoK.observe_chain)
        if k:
            x = DraftInputs(last_two, past_len, past_max + k + 1, self.history[:B], self.lengths[:B], sampling,
                            u[:, :k])
            if lk is None:
                prop = d.propose(x, k)
            elif free:
                prop = _cut(lk, k)
            else:  # the model drafts anyway: a row keeps its lookup proposal only where it promises more
                if self.auto is not None:
                    lens = lk.draft_len.tolist()
                    use = [take and (self.reqs[b] is None or self.auto.lookup_row_beats_model(
                        self.acc[b], lk.source[b], lens[b], k)) for b, take in enumerate(use)]
                pays = None if self.auto is None else (lambda b, j, s, n: self.reqs[b] is None or
                                                       self.auto.handover_pays(self.acc[b], s, j, n, k, B))
                prop = d.merge(_cut(lk, k), use, d.model_propose(x, k, use, pays), sampling)
                if self.auto is not None:  # rows that took the model's proposal: their lookup proposals (if any)
                    unused = [lk.draft[b, :n].tolist() if n and not use[b] else None  # checked as the target commits
                              for b, n in enumerate(lens)]
            draft, q, draft_len, longest = prop.draft, prop.q, prop.draft_len, prop.longest
            source, model_ran, handover, tied = prop.source or [0] * B, prop.model_ran, prop.handover, prop.tied
            passes = prop.passes if model_ran else 0
            if self.auto is not None and model_ran and handover is not None and self.auto.trim_handover:
                draft_len, longest, handover, cut = self._trim_handover(rows, draft, draft_len, source, handover,
                                                                        passes, B)
            if self.auto is not None and prop.ties[1]:
                self.auto.observe_ties(*prop.ties)
            if self.auto is not None and not model_ran and longest and whole < 0:  # free: choose what to verify
                lens = draft_len.tolist()
                capped = [min(lens[b], self.auto.cap(self.acc[b], source[b], B)) for b in range(B)]
                j = self.auto.width(B, [self.acc[b] for b in rows], [capped[b] for b in rows],
                                    [source[b] for b in rows])
                if j == 0:  # nothing verified: each proposal is checked against the target's next token
                    shadow, longest = (draft[:, 0].tolist(), lens), 0
                else:
                    capped = [min(n, j) for n in capped]
                    draft_len, longest = np.array(capped, dtype=np.int64), max(capped)
        elif lk is not None and self.auto is not None:  # a target-only step: lookup's proposals are still checked
            shadow, source = (lk.draft[:, 0].tolist(), lk.draft_len.tolist()), lk.source
        kd = self._verify_k(longest, k)
        if 0 < kd < k:
            draft, q = draft[:, :kd], (q[:, :kd] if q is not None else None)
        t1 = time.perf_counter()
        # 2. Verify: one target pass over [current, d1..dkd] -> n_accepted [B], next [B], committed [B, kd+1].
        if kd > 0:
            u_verify = np.concatenate([u[:, k:k + kd], u[:, 2 * k:]], 1)  # [B, kd+1]: accept | next
            n_acc, nxt, committed = dec.target.verify(np.concatenate([current[:, None], draft], 1), draft_len,
                                                      past_len, past_max + kd + 1, kd, sampling, u_verify, q)
        else:  # target-only step (or no row had a proposal worth verifying)
            n_acc, nxt, committed = dec.target.verify(current[:, None], np.zeros(B, dtype=np.int64), past_len,
                                                      past_max + 1, 0, sampling, u[:, -1:], None)
            draft = None
        t2 = time.perf_counter()
        # 3. Commit: the one host sync per step.
        drafted = draft_len if draft is not None else np.zeros(B, dtype=np.int64)
        host = np.concatenate([drafted[:, None], committed], 1).tolist()  # [B, 1 + kd+1]: drafted | committed
        events = []
        for b in rows:
            r = self.reqs[b]
            toks = [t for t in host[b][1:] if t >= 0]
            n, proposed = len(toks) - 1, host[b][0]
            st = r.stats
            st.steps += 1
            st.drafted += proposed
            st.accepted += n
            st.rejected += n < proposed
            st.accept_hist[n] += 1
            st.proposed_hist[proposed] += 1
            ran = kd if self.auto is not None else k
            st.k_steps[ran] = st.k_steps.get(ran, 0) + 1
            ho = handover[b] if handover is not None else None  # (j, m): the model's j tokens, then lookup's
            if proposed:  # which drafter proposed this row's draft
                by = "model+lookup" if ho is not None else \
                    "model" if model_ran and source[b] == 0 else "prompt-lookup"
                for tally, v in ((st.drafted_by, proposed), (st.accepted_by, n), (st.rejected_by, int(n < proposed)),
                                 (st.steps_by, 1)):
                    tally[by] = tally.get(by, 0) + v
            if self.auto is not None:  # what the step shows of each proposal source's acceptance
                self.auto.observe_verify(
                    self.acc[b], toks, n, proposed, source[b], handover=ho,
                    tied=bool(tied[b]) if tied is not None else None,
                    shadow=shadow[0][b] if shadow is not None and shadow[1][b] else None,
                    unused=unused[b] if unused is not None else None, unused_source=lk.source[b] if lk else 0,
                    cut=cut[b] if cut is not None else None)
            taken = r.commit(toks)
            self.history[b, self.lengths[b]:self.lengths[b] + len(taken)] = taken
            self.lengths[b] += len(taken)
            events.append((r, taken))
        # 4. Advance: past_len moves past the committed tokens (rollback is not moving it further).
        if draft is not None:
            last_acc = np.take_along_axis(draft, np.maximum(n_acc - 1, 0)[:, None], 1)[:, 0]  # [B]
            self.prev[:B] = np.where(n_acc > 0, last_acc, current)
        else:
            self.prev[:B] = current
        self.past_len[:B] = past_len + n_acc + 1
        self.current[:B] = nxt
        if model_ran:  # the draft model saw every committed position but the last two; a row that took
            for b in rows:  # lookup's proposal holds the model's own drafts after its old current token
                if lk is not None and use[b]:  # (old current position + 1 = new past_len - n_accepted)
                    self.draft_valid[b] = min(int(self.past_len[b] - n_acc[b]), self.lengths[b] - 2)
                else:
                    self.draft_valid[b] = self.lengths[b] - 2
        t3 = time.perf_counter()
        if self.auto is not None:
            self.auto.observe_costs(B, kd, t3 - t1, passes, t1 - t0 - catch_up_s, catch_up_calls,
                                    catch_up_s, catch_up_by)
            self.auto.end_step(k if model_ran or not isinstance(d, HybridDrafter) else 0,
                               [self.acc[b] for b in rows])  # a hybrid's model: its own first step is its first
        for r, _ in events:
            r.stats.draft_s += t1 - t0
            r.stats.verify_s += t2 - t1
            r.stats.host_s += t3 - t2
        for b in rows:
            if self.reqs[b].finish_reason is not None:
                self._release(b)
        return events


def _cut(p: Proposal, k: int) -> Proposal:
    """A free proposal made at a larger width, cut to k tokens."""
    if p.draft.shape[1] == k:
        return p
    draft_len = np.minimum(p.draft_len, k)
    return Proposal(p.draft[:, :k], None, draft_len, int(draft_len.max()), p.source)


def _contiguous(rows: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for b in rows:
        if runs and runs[-1][-1] == b - 1:
            runs[-1].append(b)
        else:
            runs.append([b])
    return runs
