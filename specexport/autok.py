"""Adaptive k (`k="auto"`): pick the built k that maximises expected committed tokens per second, online.

Leviathan et al.: a draft token is accepted with probability a, independently, so a step that proposes k
tokens commits on average
    E(a, k) = (1 - a^(k+1)) / (1 - a)    tokens (accepted drafts + the one recovered/bonus token),
and a batch of rows b commits sum_b E(a_b, k) per step, at the measured cost of that step:
    rate(k, B) = sum_b E(a_b, k) / (c_draft(k, B) + c_verify(k, B) + c_host(B))
k = 0 is the target-only step (E = 1, no draft), so speculation turns itself off where it does not pay
(low acceptance, or a large batch where the verify pass is no longer almost free).

Costs are measured per (k, batch size) from the step timings, as moving averages (the first call of each
is dropped: it includes binding set-up). a is estimated per request from its own history (decayed counts
of accepted drafts and rejections: the maximum-likelihood estimate of a geometric acceptance) and starts
from the running estimate over all requests, to which it returns while the request is not drafting. Untried options are tried once; every `explore_every` steps
the option measured longest ago is re-measured, so costs and acceptance follow the load.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def expected_tokens(a: float, k: int) -> float:
    """E(a, k): expected tokens a step commits when it proposes k drafts, each accepted with probability a."""
    if k == 0:
        return 1.0
    a = min(max(a, 0.0), 0.999)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def acceptance_mle(accepted: float, rejected: float) -> float:
    """Per-token acceptance probability from accepted drafts and rejections (steps that stopped early)."""
    return accepted / (accepted + rejected) if accepted + rejected > 0 else 0.0


@dataclass
class RowAcceptance:
    """Decayed counts for one request: accepted draft tokens and rejections."""

    accepted: float = 0.0
    rejected: float = 0.0

    def observe(self, n_accepted: int, proposed: int, decay: float) -> None:
        """Every step decays the counts, also one without proposals (a target-only step), so that a request
        whose estimate once fell below the pay-off point drifts back to the running estimate and is tried
        again, instead of never drafting (and so never measuring) again."""
        self.accepted = decay * self.accepted + n_accepted
        self.rejected = decay * self.rejected + (1 if n_accepted < proposed else 0)


@dataclass
class AutoK:
    ks: tuple[int, ...]  # built k values (k = 0, target-only, is always an option)
    alpha: float = 0.3  # moving-average weight of a new cost sample
    decay: float = 0.9  # per-step decay of a request's acceptance counts (about the last 10 steps)
    explore_every: int = 32
    prior_weight: float = 4.0  # pseudo-counts the running estimate is worth to a new request
    costs: dict = field(default_factory=dict)  # (k, B) -> seconds per step (draft + verify + host)
    seen: dict = field(default_factory=dict)  # (k, B) -> samples taken
    last_measured: dict = field(default_factory=dict)  # (k, B) -> step count when last measured
    global_acc: RowAcceptance = field(default_factory=RowAcceptance)
    steps: int = 0

    def options(self) -> tuple[int, ...]:
        return (0, *sorted(self.ks))

    def acceptance(self, row: RowAcceptance) -> float:
        g = self.global_acc
        prior = acceptance_mle(g.accepted, g.rejected) if g.accepted + g.rejected else 0.5
        w = self.prior_weight
        return (row.accepted + w * prior) / (row.accepted + row.rejected + w)

    def choose(self, B: int, rows: list[RowAcceptance]) -> int:
        self.steps += 1
        for k in self.options():  # every option measured (twice: the first sample is set-up) at this batch size
            if self.seen.get((k, B), 0) < 2:
                return k
        if self.steps % self.explore_every == 0:  # refresh the stalest measurement
            return min(self.options(), key=lambda k: self.last_measured.get((k, B), -1))
        return max(self.options(), key=lambda k: self.rate(k, B, rows))

    def rate(self, k: int, B: int, rows: list[RowAcceptance]) -> float:
        """Expected committed tokens per second for option k at batch size B."""
        cost = self.costs.get((k, B))
        if not cost:
            return 0.0
        return sum(expected_tokens(self.acceptance(r), k) for r in rows) / cost

    def observe_cost(self, k: int, B: int, seconds: float) -> None:
        key = (k, B)
        n = self.seen.get(key, 0)
        self.seen[key] = n + 1
        self.last_measured[key] = self.steps
        if n <= 1:  # the first sample includes set-up; the second starts the average
            self.costs[key] = seconds
        else:
            self.costs[key] = (1 - self.alpha) * self.costs[key] + self.alpha * seconds

    def observe_acceptance(self, row: RowAcceptance, n_accepted: int, proposed: int) -> None:
        row.observe(n_accepted, proposed, self.decay)
        if proposed:
            self.global_acc.observe(n_accepted, proposed, 0.99)
