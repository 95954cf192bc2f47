"""A draft model's plan: what a k-token chain promises (E_t, with a chain's near-tie counted apart), and the k to
draft before a step: the best rate, the probe k, the upper bound that keeps learning, probes within the
exploration budget, the c(0) refresh."""

from __future__ import annotations

from .acceptance import RowState, expected_tokens
from .costs import bucket


class ModelPlan:
    """AutoK's choices for a draft model (its fields: controller.AutoK)."""

    def splits(self) -> bool:
        """Are a chain's drafts at a near-tie counted apart (`tie_acc`) from the row's others (source 0)?"""
        return self.split_ties and self.price_ties and not self.handover

    def tie_acceptance(self) -> float:
        """a_tie: the acceptance of a draft at a near-tie, over all requests (one pseudo-trial at 0.5)."""
        return (self.tie_acc.accepted + 0.5) / (self.tie_acc.evidence + 1.0)

    def model_tokens(self, a: float, k: int, a_tie: float | None = None) -> float:
        """Expected committed tokens of one row's k-token chained draft at acceptance a (per drafted token). The
        chain ends at a near-tie (the margin stop, at rate t per position checked, as `passes` prices it), so
        draft i exists with probability (1 - t)^(i - 1), and is the tie, accepted at a_tie, with probability t
        (`splits`; else at a): 1 + sum_{i=1..k} (a (1 - t))^(i - 1) ((1 - t) a + t a_tie). a_tie given: every
        draft accepted, say (1.0). E(a, k) where no tie has been seen, with `price_ties` off, or for a chain that
        hands rows over to lookup (`handover`)."""
        tie, seen = self.ties
        if k <= 0 or self.handover or not (self.price_ties and tie > 0 and seen > 0):
            return expected_tokens(a, k)
        a, t = min(max(a, 0.0), 0.999), tie / seen
        if a_tie is None:
            a_tie = self.tie_acceptance() if self.splits() else a
        x = a * (1.0 - t)
        return 1.0 + ((1.0 - t) * a + t * a_tie) * (1.0 - x ** k) / (1.0 - x)

    def _model_rate(self, B: int, rows: list[RowState], k: int, catch_up: float, estimate=None,
                    a_tie: float | None = None) -> float:
        """Expected committed tokens per second of a k-token model draft (its catch-up amortised), at each row's
        point estimate (or `estimate(row)`; a_tie: model_tokens')."""
        estimate = estimate or self.acceptance
        return sum(self.model_tokens(estimate(r), k, a_tie) for r in rows) / (
            self.draft_cost(k, B) + self.verify_cost(k, B) + catch_up / self.amortize)

    def plan(self, B: int, rows: list[RowState], missing: int = 0, free: bool | None = None) -> int:
        """The k to draft before the step (lookup: the largest, its proposals are free; `width` then picks
        what to verify). missing: the most committed tokens a row's draft model has not seen (its catch-up).
        free: this step's proposals cost no pass (default: the drafter's kind; a hybrid step where every row
        matched lookup)."""
        self.steps += 1
        left = self.refresh_left if self.refreshing else 0  # a refresh goes on only right after its own steps
        checking = self.checking and left > 0
        self.refreshing, self.refresh_left, self.checking = False, 0, False
        if self.free_drafts if free is None else free:
            return max(self.ks)
        c0 = self.verify_cost(0, B)
        if c0 is None:
            return 0  # measure the target-only step at this batch size first
        kmin = min(self.ks)
        if self.draft_cost(1, B) is None:  # the draft's cost at this bucket is unknown: one probe measures it
            return kmin
        catch_up = self.catch_up(missing, B)[0]
        first = any(r.spec_steps == 0 for r in rows)
        fresh = first and not self.prior_settled()
        kmin = self.probe_k(B, c0, catch_up)
        best, best_rate = 0, (1 + self.margin) * len(rows) / c0
        for k in self.ks:
            if fresh and k > kmin:
                continue  # a request's first speculative step is a probe (the smallest k that could pay), while
                # the running estimate is thin (prior_settled)
            rate = self._model_rate(B, rows, k, catch_up)
            if rate > best_rate:
                best, best_rate = k, rate
        if not best:  # too little evidence to rule drafting out: keep learning at the k whose upper bound pays most
            # (a request's first step at most at the probe k: its prior, settled or not, says no k pays)
            up = {k: self._model_rate(B, rows, k, catch_up, self.upper) for k in self.ks if not (first and k > kmin)}
            k = max(up, key=up.get)
            if up[k] > best_rate:
                best = k
        if best:
            self.off_steps = self.off_seconds = 0
            self.interval = self.probe_every
            key = ("verify", 0, bucket(B))
            check = not left and self._refresh_moved(key)
            due = self.refresh if self.costs.settled(key) else self.refresh_first  # (a first sample: set-up heavy)
            if left or check or self.steps - self.costs.when.get(key, 0) >= due:
                if left:  # the refresh goes on: its next sample is checked against c(0) as it is now (a
                    self.refresh_left, self.checking, self.refresh_ref = left - 1, checking, c0  # check's: unread)
                elif check:  # one clean step; after any other step than the refresh's, a graph switch first
                    self.refresh_left = 0 if self._last == (0, bucket(B)) else 1  # (its time is not a sample)
                    self.refresh_checked = self.checking = True
                else:  # a refresh starts
                    self.refresh_left, self.refresh_ref, self.refresh_checked = self.refresh_steps - 1, c0, False
                if not (self.refresh_left or self.checking):
                    self.refresh_last = self.steps  # the refresh's last step: the sample a check looks at
                self.refreshing = True  # (a hybrid then runs no lookup step instead: batch.py)
                return 0  # the reference cost is stale: re-measure it (drafting compares against it)
            return best
        return self._maybe_probe(B, rows, kmin, c0, catch_up)

    def prior_settled(self) -> bool:
        """Is the running estimate of the model's acceptance over earlier requests worth its full weight to a new
        request (`model_prior_weight` pseudo-trials, Estimates._prior_weight)? Then a request's first step drafts
        at the k that estimate promises, as its later steps do until their own evidence takes over; before, at
        the probe k (`trust_prior` off: always). The probe k cost a hybrid's short requests a step: replayed
        (10% cost noise, 4 seeds), the hybrid at auto 2.128 -> 2.152x target-only pre-packed and 2.840 -> 2.860x
        without pre-packing, the model alone 1.714 -> 1.718x and 2.609 -> 2.628x."""
        return self.trust_prior and self.prior_cap(0) >= self.model_prior_weight

    def _refresh_moved(self, key) -> bool:
        """Is c(0)'s newest sample the last refresh's last step, more than `refresh_tol` above the c(0) believed
        before it, and not checked yet? Then a check: one more clean target-only step (once per refresh; where other
        steps came first, at the next step the model drafts, after a step that pays the graph switch and is not
        counted), and c(0) is the median of the refresh's samples, of two the lower (Costs, low). Past the graph
        switch, a refresh's last step is often c(0)'s only sample until the next refresh, 64 steps on: one stall
        there made every verify look cheap against c(0) for that long, while a machine that really slowed down
        measures the same twice. Only upwards: a stall only slows a step, and a faster sample is taken as it is."""
        xs = self.costs.samples.get(key)
        if self.refresh_checked or not xs or xs[-1][0] != self.refresh_last or not self.refresh_ref:
            return False
        return xs[-1][1] > self.refresh_ref * (1.0 + self.refresh_tol)

    def expects_drafting(self, B: int, missing: int = 0) -> bool:
        """Should a new request's prompt be prefilled into the draft at admission (a draft model)? Yes unless
        the measured costs say that the probe k does not pay even at a fresh request's upper bound (its first
        step's test), with the catch-up that the batch's running rows would need first (`missing`: the most
        committed tokens one of them has not shown the draft). Deciding this from the last step's choice instead
        was a trap: once off, every new prompt needed a full catch-up, whose cost then kept drafting off. Judging
        the fresh request alone was the opposite trap: under load (16 clients, rows that ran target-only steps
        for a while) the batch never drafted again, and every admission still prefilled the draft, as dear as
        the target's own prefill: the OpenAI server ran at 0.73x target-only."""
        if self.free_drafts:
            return False
        c0, d = self.verify_cost(0, B), self.draft_cost(1, B)
        if c0 is None or d is None:
            return True
        catch_up = self.catch_up(missing, B)[0]
        kmin = self.probe_k(B, c0, catch_up)  # a fresh request's first step, at most at its upper bound
        ks = self.ks if self.prior_settled() else (kmin,)  # (once the prior is settled, at any k: plan)
        return max(self._model_rate(B, [RowState()], k, catch_up, self.upper) for k in ks) > (1 + self.margin) / c0

    def probe_k(self, B: int, c0: float, catch_up: float = 0.0) -> int:
        """The k of a probe and of a request's first step: the smallest that could pay if every draft were
        accepted (the smallest built k, unless verifies are dear: without pre-packing a k=2 verify costs two
        target-only steps and only a wide k can pay)."""
        for k in sorted(self.ks):
            if self._model_rate(B, [RowState()], k, catch_up, lambda r: 1.0, 1.0) > (1 + self.margin) / c0:
                return k
        return min(self.ks)

    def _maybe_probe(self, B: int, rows: list[RowState], k: int, c0: float, catch_up: float) -> int:
        """Off: a probe at `probe_k`, only if drafting could pay at all (every draft accepted) and the
        probe's expected loss fits the exploration budget."""
        self.off_steps += 1
        self.off_seconds += c0
        self.interval = self.interval or self.probe_every
        if not self.could_pay(B, c0):
            return 0  # cannot pay even if every draft were accepted, at the lowest costs seen
        cost = self.draft_cost(k, B) + self.verify_cost(k, B)
        loss = cost + catch_up - c0 * sum(self.model_tokens(self.acceptance(r), k) for r in rows) / len(rows)
        if loss <= 0:  # the point estimate says it pays, only its confidence bound does not yet: more evidence
            return k
        if self.off_steps >= self.interval and loss <= self.explore * self.off_seconds:
            self.off_steps = self.off_seconds = 0
            self.interval *= 2  # reset to probe_every once drafting pays again
            return k
        return 0

