"""What AutoK learns from a step: its costs (the graph switch charged to the step that caused it), the near-tie
rate, acceptance per row and source (a draft model's chain in two classes)."""

from __future__ import annotations

from .acceptance import RowAcceptance, RowState, matched
from .costs import bucket


class Observations:
    """AutoK's measurements (its fields: controller.AutoK)."""

    def observe_costs(self, B: int, j: int, verify_s: float, draft_passes: int = 0, draft_s: float = 0.0,
                      catch_up_calls: int = 0, catch_up_s: float = 0.0, catch_up_by: str = "pass") -> None:
        """One step's measured seconds: the verify over j drafts (0: target-only), the draft passes, the
        catch-up. A target-only step right after a speculative one runs slower (the engine switches graphs:
        about +10% on the 2-core CPU); that excess is charged to the speculative step that caused it, and c(0)
        keeps the steady target-only cost."""
        Bb, t = bucket(B), self.steps
        if Bb == 1 and j in self.free_ks:  # the target-only step's own graph: a sample of c(0), no switch after it
            j = 0
        last, self._last = self._last, (j, Bb)
        c0 = self.costs.get(("verify", 0, Bb))
        strict = self.refreshing and j == 0  # a refresh's c(0): past the horizon, the old samples go (Costs)
        if j == 0 and last[0] and last[1] == Bb and c0 is not None and self.costs.settled(("verify", 0, Bb)):
            self.costs.add_to_last(("verify", last[0], Bb), max(verify_s - c0, 0.0))
            if verify_s < c0 and not self.checking:  # even after a switch it was faster: c(0) was too high (it
                self.costs.observe(("verify", 0, Bb), verify_s, t, strict, low=True)  # is re-measured; a check's
            self.costs.when[("verify", 0, Bb)] = t  # own clean step follows, ModelPlan._refresh_moved)
        else:  # a stale width's new sample replaces its old ones (Pricing._fresh_line)
            key = ("verify", j, Bb)
            self.costs.observe(key, verify_s, t, strict or (j > 0 and self.stale(key)), low=j == 0)
        if draft_passes:  # (a stale d: a probe's new sample replaces its old ones, Pricing.could_pay)
            key = ("draft", 1, Bb)
            self.costs.observe(key, draft_s / draft_passes, t, self.stale(key))
        if catch_up_calls:
            self.costs.observe(("catch_up", catch_up_by, Bb), catch_up_s / catch_up_calls, t)

    def observe_ties(self, ties: int, checked: int) -> None:
        """A chained draft checked `checked` draft positions for a near-tie and found `ties`."""
        if checked <= 0:
            return
        keep = self.tie_decay ** checked
        weight = (1.0 - keep) / (1.0 - self.tie_decay)  # the positions' decayed weights (one step: all alike)
        self.ties[0] = self.ties[0] * keep + ties / checked * weight
        self.ties[1] = self.ties[1] * keep + weight

    def observe_chunk(self, B: int, seconds: float) -> None:
        """A draft-model prefill chunk over B rows (at admission): a sample of a catch-up chunk call."""
        self.costs.observe(("catch_up", "chunk", bucket(B)), seconds, self.steps)

    def observe_row(self, row: RowState, source: int, n_accepted: int, rejected: bool) -> None:
        """One row's verified proposal (or a shadow check: n_accepted 1 or rejected)."""
        row.get(source).observe(n_accepted, rejected, self.model_decay if self.is_model(source) else self.decay)
        g = self.global_acc.get(source)
        if g is None:
            g = self.global_acc[source] = RowAcceptance()
        g.observe(n_accepted, rejected, 0.99)

    def observe_chain(self, row: RowState, n_accepted: int, proposed: int, tied: bool, rejected: bool) -> None:
        """A draft model's verified proposal of `proposed` tokens, n accepted (rejected: the verify stopped it).
        tied: its last draft was a near-tie, where the chain ended; counted apart (`splits`), it teaches a_tie,
        and the row's own estimate keeps the drafts not at a checked near-tie."""
        if not (tied and proposed and self.splits()):
            return self.observe_row(row, 0, n_accepted, rejected)
        clear = proposed - 1
        self.observe_row(row, 0, min(n_accepted, clear), rejected and n_accepted < clear)
        if n_accepted >= clear:
            self.tie_acc.observe(n_accepted - clear, rejected, 0.99)

    def observe_verify(self, row: RowState, toks: list[int], n: int, proposed: int, source: int,
                       full: float | None = None, handover: tuple[int, int] | None = None, tied: bool | None = None,
                       shadow: int | None = None, unused: list[int] | None = None, unused_source: int = 0,
                       cut: tuple[int, int] | None = None) -> None:
        """What one row's step shows (batch.Batch.step, and bench/replay.py the same way): toks, the tokens the
        target committed; n of the `proposed` drafts (from `source`) accepted; full, how many of them the target
        would accept (n; a replay at a request's end, inf: not known to be rejected).
        - handover (j, s): the model's j tokens, then lookup's from source s: each part counts for its own source;
        - tied (the model's chain ran: did it end at a near-tie?): `observe_chain`;
        - shadow: a proposal's first token that was not verified (a target-only step): did the target pick it?
        - unused: the lookup proposal (source unused_source) a row dropped for the model's: as far as the
          committed tokens go (a one-hot draft's token is accepted with P(the target's token = it));
        - cut (token, source): the first lookup token cut from a handover, where the verify reached it."""
        full = n if full is None else full
        if proposed and handover is not None:
            j, s = handover
            self.observe_row(row, 0, min(n, j), full < j)
            if n >= j:
                self.observe_row(row, s, n - j, full < proposed)
        elif proposed and tied is not None and source == 0:
            self.observe_chain(row, n, proposed, tied, full < proposed)
        elif proposed:
            self.observe_row(row, source, n, full < proposed)
        elif shadow is not None:
            hit = toks[0] == shadow
            self.observe_row(row, source, int(hit), not hit)
        if unused:
            m = matched(unused, toks)
            self.observe_row(row, unused_source, m, m < min(len(unused), len(toks)))
        if cut is not None and n == proposed and n < len(toks):
            hit = toks[n] == cut[0]
            self.observe_row(row, cut[1], int(hit), not hit)

    def end_step(self, k: int, rows: list[RowState]) -> None:
        if k:
            for r in rows:
                r.spec_steps += 1

