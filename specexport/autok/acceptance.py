"""Acceptance: E(a, j), a request's decayed counts per proposal source, and the estimates decisions use (the point
estimate, the confidence bound lookup acts on, the upper bound that keeps a draft model learning). The terms are
defined in the package's docstring (specexport/autok/__init__.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def expected_tokens(a: float, k: int) -> float:
    """E(a, k): expected tokens a step commits when it proposes k drafts, each accepted with probability a."""
    if k <= 0:
        return 1.0
    a = min(max(a, 0.0), 0.999)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def acceptance_mle(accepted: float, rejected: float) -> float:
    """Per-token acceptance probability from accepted drafts and rejections (steps that stopped early)."""
    return accepted / (accepted + rejected) if accepted + rejected > 0 else 0.0


@dataclass
class RowAcceptance:
    """Decayed counts for one proposal source: accepted draft tokens and rejections."""

    accepted: float = 0.0
    rejected: float = 0.0
    trials: int = 0  # undecayed: how much this request has shown (the prior's weight shrinks with it)

    def observe(self, n_accepted: int, rejected: bool, decay: float) -> None:
        """n accepted draft tokens, then a rejection or not: each is one trial, and each trial decays the older
        ones (a step that accepted 8 tokens weighs 8 trials, so the estimate forgets by trials, not steps)."""
        r = 1 if rejected else 0
        old = decay ** (n_accepted + r)
        self.accepted = old * self.accepted + (1 - decay ** n_accepted) / (1 - decay) * decay ** r
        self.rejected = old * self.rejected + r
        self.trials += n_accepted + r

    @property
    def evidence(self) -> float:
        return self.accepted + self.rejected


@dataclass
class RowState:
    """One request's acceptance per proposal source, and how many speculative steps it has had."""

    sources: dict = field(default_factory=dict)  # source -> RowAcceptance
    spec_steps: int = 0

    def get(self, source: int) -> RowAcceptance:
        acc = self.sources.get(source)
        if acc is None:
            acc = self.sources[source] = RowAcceptance()
        return acc


def matched(draft: list[int], committed: list[int]) -> int:
    """How many leading draft tokens the committed tokens repeat (a one-hot draft's acceptance at greedy)."""
    n = 0
    for a, b in zip(draft, committed):
        if a != b:
            break
        n += 1
    return n


def _stderr(a: float, n: float) -> float:
    """The standard error of an acceptance estimate a over n (effective) trials."""
    return math.sqrt(a * (1 - a) / (n + 1))


class Estimates:
    """AutoK's acceptance estimates (its fields: controller.AutoK)."""

    def prior(self, source: int) -> float:
        """The running estimate over all requests (one pseudo-trial at 0.5 keeps it from 0 or 1 early)."""
        g = self.global_acc.get(source) or RowAcceptance()
        return (g.accepted + 0.5) / (g.evidence + 1)

    def is_model(self, source: int) -> bool:
        """Source 0 of a drafter with a model (model or hybrid) is the model; lookup sources are n-gram lengths."""
        return source == 0 and not self.free_drafts

    def prior_cap(self, source: int) -> float:
        """The most pseudo-trials the running estimate can be worth: no more than its own evidence (+ 1)."""
        g = self.global_acc.get(source)
        return (g.evidence if g is not None else 0.0) + 1.0

    def _prior_weight(self, source: int, acc: RowAcceptance) -> float:
        """Pseudo-trials of the running estimate in a request's estimate; the request's own evidence takes
        over as it grows, and a draft model's prior counts only as far as it explains that evidence
        (`fits_prior`)."""
        cap = self.prior_cap(source)
        if self.is_model(source):
            return min(self.model_prior_weight * 16 / (16 + acc.trials), cap) * self.fits_prior(source, acc)
        return min(self.prior_weight * 4 / (4 + acc.trials), cap)

    def fits_prior(self, source: int, acc: RowAcceptance) -> float:
        """P(the request is like the others | its counts): a two-way mixture, the request's drafts accepted at
        the running estimate a (prior 1 - `prior_doubt`) or at an acceptance of its own, uniform on [0, 1]. With
        n accepted and r rejected (decayed counts), the likelihoods are a^n (1 - a)^r and B(n + 1, r + 1). Two
        rejections and nothing accepted against a = 0.98 leave the prior (0.03), two accepted then one rejected
        do not (0.80; decayed counts). With the prior's full weight, a request whose drafts all failed after
        requests that accepted them drafted on for 12 steps (hand-forced costs: 0.92-0.94x target-only; 0.96 now)."""
        if not self.prior_doubt or not acc.evidence:
            return 1.0
        a = min(max(self.prior(source), 0.01), 0.99)
        n, r = acc.accepted, acc.rejected
        like = n * math.log(a) + r * math.log(1.0 - a)
        other = math.lgamma(n + 1) + math.lgamma(r + 1) - math.lgamma(n + r + 2)
        odds = self.prior_doubt / (1.0 - self.prior_doubt) * math.exp(min(other - like, 50.0))
        return 1.0 / (1.0 + odds)

    def acceptance(self, row: RowState, source: int = 0) -> float:
        """The point estimate of a_b,s."""
        acc = row.get(source)
        w = self._prior_weight(source, acc)
        return (acc.accepted + w * self.prior(source)) / (acc.evidence + w)

    def confident(self, row: RowState, source: int = 0, z: float | None = None) -> float:
        """What decisions use: the estimate less `z` standard errors over its effective trials (or less the `z`
        given). A short memory is noisy, and acting on its highs (a verify right after two lucky matches) is a
        systematic loss."""
        a, acc = self.acceptance(row, source), row.get(source)
        z = self.z if z is None else z
        return max(a - z * _stderr(a, acc.evidence + self._prior_weight(source, acc)), 0.0)

    def stake_z(self, cj: float, c0: float) -> float:
        """The standard errors a lookup verify of measured cost cj is discounted by: `z` times its stake, what a
        verify that commits one token costs beyond a target-only step, in target-only steps, up to one (`z`
        itself without `z_by_stake`). Caution costs speculation where it is cheap to be wrong: pre-packed, a
        k = 2 verify costs 1.11 target-only steps, so a wrong one loses 0.11 of a step while a right one gains
        one or two tokens; without pre-packing it costs 1.78 (0.78 `z`) and k = 8 2.19 (the full `z`)."""
        if not self.z_by_stake:
            return self.z
        return self.z * min(max(cj / c0 - 1.0, 0.0), 1.0)

    def upper(self, row: RowState, source: int = 0) -> float:
        """The estimate plus `z_upper` standard errors over every trial the request has shown (undecayed) and its
        prior's pseudo-trials: the acceptance its evidence does not rule out yet."""
        a, acc = self.acceptance(row, source), row.get(source)
        return min(a + self.z_upper * _stderr(a, acc.trials + self._prior_weight(source, acc)), 1.0)

