"""Adaptive k (`k="auto"`): per step, the draft length with the highest expected committed tokens per second,
with the guarantee that it does not lose to target-only decoding.

Terms (B: the batch's rows; b: one row; j: a verify width, 0 = a target-only step; K: the largest built k)
  E(a, j)    expected tokens a step commits when it verifies j drafts, each accepted with probability a
             (Leviathan et al.): (1 - a^(j+1)) / (1 - a); rows with a shorter proposal count its length
  a_b,s      row b's acceptance for proposals from source s (prompt lookup: the matched n-gram length; a
             draft model: one source): accepted / (accepted + rejections), the MLE of a geometric acceptance,
             over counts that decay per trial (prompt lookup: about the last 10 draft tokens; a draft model:
             about the last 20, `model_decay`, since its acceptance varies less within a request; replayed
             without pre-packing, 10 kept a 0.98 draft off after two rejections) and are pulled towards the
             running estimate over all requests with pseudo-trials that shrink as the request shows its own:
             prompt lookup `prior_weight` (1) x 4 / (4 + its trials), a draft model `model_prior_weight` (8)
             x 16 / (16 + its trials). It starts from the other requests, then follows its own. A draft
             model's acceptance varies less between requests than lookup's, and with a weak prior one early
             rejection (3 trials: 0.69 against 0.98 over all requests) turned a good draft off for the rest
             of its request. Lookup's verify decisions use a lower confidence bound (less `z` = 0.5
             standard errors over the effective trials): its evidence is mostly one-token shadow checks, a
             short memory of them is noisy, and acting on its highs is a loss. With pre-packed verifies a
             full standard error was too timid (alternating A/B, 24 prompts x 2: auto / best fixed k 0.95
             -> 0.98, worst prompt / target-only 0.97 -> 0.99). At a verify width j the bound is less
             z min(1, c(j) / c(0) - 1) standard errors (`stake_z`): caution in proportion to what a
             wrong verify costs over a target-only step (pre-packed, k = 2 at 1.11 c(0) is cheap to be
             wrong about; without pre-packing, at 1.78-2.19 c(0), about the full z stays). Replayed, 48
             prompts x 30 seeds of 10% cost noise: prompt lookup +1.1% and +0.7%, auto / best fixed k
             0.961 -> 0.971 and 0.962 -> 0.969; unchanged without pre-packing and for the hybrid (30
             seeds: its matches are mostly verified whole, at the upper bound); real runs (tools/autok_ab.py
             --drafter prompt-lookup --set z_by_stake=false): 1.020x pre-packed, 1.039x without pre-packing,
             the lowest prompt 1.035 -> 1.015 and 0.933 -> 1.000. A draft model's evidence is k tokens per
             step and its pay-off needs high acceptance: it uses the point estimate (with the bound, one
             rejection turned a 1.5x draft off), and while that says no, the upper bound (+ `z_upper` = 1
             standard error over every trial of the request and its prior) keeps drafting, at the k
             whose upper bound pays most: thin evidence does not turn a draft off
  c(j, B)    measured seconds of the verify step over j drafts (host commit included), c(0, B) = a target-only
             step; per batch bucket (1, 2, 4, 8, ... rows). An unmeasured width is estimated from the nearest
             measured bucket b: c(0, B) + (c(j, b) - c(0, b)) B / b (each extra row costs what it did at b: a
             batched verify is compute-bound on a CPU; on a GPU c(0, B) c(j, b) / c(0, b)), or c(j, b) B / b
             for an engine that verifies row by row; else (1 + 0.05 j) c(0, B) (times B row by row):
             optimistic, so that a width is tried once when the drafts look good
  d(B)       measured seconds per draft-model pass
  P(k, B)    expected passes of a k-token draft over B rows: k, but for a chained draft that ends a row at a
             near-tie (drafters.ModelDrafter, the margin stop), seen at rate t per draft position checked
             (decayed over about the last 100): sum_{i<k} 1 - (1 - (1 - t)^i)^B (`price_ties`). Priced at k
             passes, the fp32 SmolLM2 target's int8 copy stayed at k = 4 where k = 8 with the stop paid more:
             replayed (48 prompts x 6 seeds of 10% cost noise), the model at auto +1.0% and +0.8%, the hybrid
             +0.1% and +0.4%
  E_t(a, k)  what such a chain promises a row: its draft i exists with probability (1 - t)^(i - 1) and is the
             tie that ends it with probability t, so 1 + sum_{i=1..k} (a (1 - t))^(i - 1) ((1 - t) a + t a_tie)
             (`model_tokens`). The drafts are counted in two classes (`split_ties`, `observe_chain`): a is the
             row's acceptance of the drafts not at a checked near-tie (the chain's k-th draft is never checked),
             a_tie the acceptance of a chain's last draft at a near-tie, over all requests (SmolLM2's int8 copy:
             0.99 against about 0.6). One a for both (t a_tie folded in) undersold long chains of clear
             drafts: at the costs and rates a stop-46 run believed it rated k = 4 above k = 8, where k = 8 ran
             3.2% faster. Priced at P(k, B)
             passes but promised E(a, k), a wide draft looked cheap: replayed with k = 16 built (fp32 SmolLM2,
             its int8 copy, t 0.03-0.04; 12 seeds of 10% cost noise), the model alone at auto ran 0.968x and
             0.939x fixed k = 8 on the bench and held-out prompts, 0.981x and 0.955x with E_t (+1.3%, +1.8%;
             +0.1% and -0.2% with ks 2, 4, 8). A hybrid's chain that hands rows over to lookup goes on past the
             model's drafts where a row finds a match: it keeps E(a, k) (with E_t it replayed 0.5-1.2% slower).
             A hybrid chain without the handover (`handover=False`, or a fused draft model with a cache of its
             own) replayed -0.6% to +2.9% with E_t, its lowest prompt up on all four traces
  u(g, B)    the catch-up of a draft model g committed tokens behind (the batch's largest gap: rows catch up
             together), by the cheaper of ceil(g / 2) draft calls that rewrite two tokens each and ceil(g / C)
             prefill chunks, each measured per call (chunks also at admission); for a quantized copy of the
             target whose cache mirrors the target's, a copy of the target's cache rows (measured per row-position),
             and none for a fused draft of the target's own layers (`quant:` or `layers:`), which runs over the
             target's cache (drafters.ModelDrafter.link_kv)
Rule
  Prompt lookup (proposals cost no pass): propose first, then verify the width j in {0} + built ks (rows
    truncated to j; from a source it has no evidence for yet a row verifies at most the widest k whose
    measured verify costs what the smallest's does, within `margin`: the smallest, unless they cost the same) that
    maximises sum_b E(a_b, min(len_b, j)) / c(j, B) over j = 0 (n / c(0, B); n: occupied rows) and the widths
    whose promise over target-only beats their extra time by `margin` (5%): sum_b E - n > (1 + margin) n
    (c(j, B) / c(0, B) - 1), a guard against model error (the geometric acceptance model, noisy costs) that
    asks little of a verify that costs about a target-only step (pre-packed: c(2) = 1.09 c(0) on fp32 SmolLM2;
    the former guard, 5% over target-only's rate, asked a k = 2 verify there for 1.145 tokens and left a
    lookup that accepted 1 token in 5 off: +2.3% on that engine, +3.4% on the default Q4_1 engine, 0% without
    pre-packing, alternating A/B). No match anywhere costs exactly a target-only step. At a
    target-only step the proposals are still checked against the token the target commits ("shadow"
    acceptance: for a one-hot draft, P(the target's token = d) is d's acceptance probability), so acceptance
    is learnt without spending a verify on it. Likewise a hybrid row whose lookup proposal the model's
    replaced checks it against the committed tokens: lookup keeps learning while the model drafts.
  Hybrid: where every row matched lookup and the model pays (its best rate below beats target-only's by
    `margin`), the free step verifies the matches whole (the smallest built k that holds the longest, no `cap`)
    unless, even at each row's upper bound (`upper`), they promise less than the model's step: matches come in
    runs (copied text), and the first-token rate undersells them (`free_width`; replayed, 48 prompts with 10%
    cost noise: +3.0% and +5.9% over the former rule, which verified them only where the width `width` picks
    at the confident estimate beat the model: the model drafted where a match was right). Where the model
    does not pay, the free step at the width `width` picks, unless the model promises more. Where the model
    drafts anyway, a row keeps its lookup proposal only where it promises more; where the model does not pay
    (under load), the rows' lookup proposals are verified as prompt lookup alone would (the rule above).
    Where the model hands a row over to lookup mid-draft (drafters.HybridDrafter), its j tokens count for
    the model and the rest, if the verify reached them, for lookup's source; d(B) is measured per pass run,
    and the plan still prices k passes (a handover only makes the step cheaper than planned). The passes
    then spent, lookup's rest is verified only as far as it pays (`handover_width`, `trim_handover`): the
    built width, holding every row's model tokens, with the most expected tokens over the step's time
    (passes + c(j)), model tokens at the point estimate and lookup's at its bound; a row's first cut token is
    shadow-checked. Only one-hot lookup tokens are cut, before the verify: lossless. Before, a handover after
    one model token verified lookup's rest of k whole (c(8) = 1.48 c(0) for about 2 tokens). Replayed (10%
    cost noise, 4 seeds), the hybrid at auto: +1.7% and +0.7% on the bench and held-out prompts with ks 2, 4,
    8; +5.9% and +7.3% with k = 16 built too.
  Draft model (each drafted token costs a pass): before drafting, k maximises
    sum_b E_t(a_b, k) / (P(k, B) d(B) + c(k, B) + u(g, B) / R) against (1 + margin) n / c(0, B) (n: occupied rows)
    (the catch-up for tokens committed while it was off, amortised over R steps).
    A request's first speculative step is at most the probe k (no evidence yet: a cheap probe), the smallest
    built k that could pay if every draft were accepted (without pre-packing a k=2 verify costs two target-only
    steps and only k=8 can pay). While the point estimate says no k pays but its upper bound (+ `z_upper`
    standard errors over all the request's trials and its prior's) says one does, the k that pays most at the
    upper bound drafts (evidence is gathered, not assumed; with only the smallest k allowed here, a draft whose
    smallest k cannot pay was turned off for the rest of a request by two rejections). A new request's prompt
    is prefilled into the draft at admission (as at a fixed k) unless the measured costs say the probe k does
    not pay even at a fresh request's upper bound, with the catch-up the batch's running rows need first;
    otherwise the draft catches up if drafting turns on.
    While off, the counts stay frozen and a probe (the probe k) runs only if the draft could pay at all
    (if every draft were accepted, some k would beat target-only), and then either
      - the point estimate says it pays (an expected gain; only the confidence bound is not convinced yet), or
      - its expected loss fits `explore` (2%) of the time spent off since the last probe, and at least
        `probe_every` steps have passed, doubling after each such probe.
    So in N steps off at acceptance too low to pay there are at most 1 + log2(N / probe_every) probes,
    costing at most 2% of that time; the upper-bound steps above come on top, and each one that pays restarts
    the probe interval (their number is bounded by how fast the bound tightens: a few steps per request for
    a draft that does not pay, see tests/test_autok.py).
  Costs are the median of the last 5 samples within 32 steps of the newest (a passing stall moves a median
  less than a moving average, and an old sample does not outvote a new one), but of no fewer than the last 3
  (a width run rarely is not set by one stall until it runs again). A target-only step right after
  a speculative one is slower (the engine switches graphs); the excess is charged to the speculative step.
  Where the batch-1 target-only step is itself a k = 1 verify (`free_ks`: a CPU whose one-row linears round
  otherwise, backends/row_probe.py), k = 1 at batch 1 costs c(0) by definition and its steps are c(0)'s samples
  (measured apart, the one-sided switch charge above pushed c(1) over c(0) by the noise and turned k = 1 off
  for good after about one pass over the bench prompts).
  The first sample of each (width, bucket) is set-up heavy: it counts as the lower of itself and the
  estimate until a second sample replaces it (so a width is probed at most twice per bucket, over the
  decoder's life, not per request). A draft model that has drafted for `refresh` (64) steps runs two
  target-only steps, so that the reference it is compared against is not stale (lookup measures c(0) at
  every step without a match). The first pays the graph switch (charged to the step before it, above), so
  only the second can raise c(0). With one step every 32, c(0) could only fall: over the fp32 SmolLM2
  target, three decoders on one engine in one run came to price c(8) at 1.55, 1.61 and 2.34 c(0) (stop 46).
Why it holds: a lookup step is a verify only when its expected rate beats the measured target-only rate;
mistakes cost one verify each and teach a_b; a draft model is tried at the probe k while its evidence is
thin, then only within the 2% budget. The README ("Adaptive k") gives the measurements. Known approximation:
a request's own trials also feed the running estimate that is its prior, so for the first requests the
upper bound's evidence is overstated (by up to 2x in trials).
"""

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


def bucket(B: int) -> int:
    """Batch sizes share cost measurements per power of two (1, 2, 4, 8, 16, ...)."""
    return 1 << max(B - 1, 0).bit_length()


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


@dataclass
class Costs:
    """Measured seconds per key: the median of the last `window` samples taken within `horizon` steps of the
    newest (a passing stall moves a median less than a moving average; an old sample does not outvote a new
    one), but never fewer than the last `keep` (at most `window`): a width auto seldom runs is not set by one
    sample, so one stall does not make it look dear until it is run again (stop 47: prompt lookup ended a run
    believing c(4) = 2.45 c(0), where fixed k = 4 ran 1.08 c(0) a step). A `strict` sample (a draft model's
    c(0) refresh, AutoK.refresh) keeps to the horizon alone: a slower machine moves c(0) at the first refresh.
    The first sample of a key is provisional (it includes set-up)."""

    window: int = 5
    horizon: int = 32
    keep: int = 3
    samples: dict = field(default_factory=dict)  # key -> [(step, seconds)], oldest first
    count: dict = field(default_factory=dict)
    when: dict = field(default_factory=dict)  # key -> the step it was last measured at
    median: dict = field(default_factory=dict)  # key -> the median of its samples (kept current)

    def observe(self, key, seconds: float, step: int = 0, strict: bool = False) -> None:
        n = self.count.get(key, 0)
        self.count[key] = n + 1
        self.when[key] = step
        old = [] if n == 1 else self.samples.get(key, [])
        recent = [x for x in old if x[0] > step - self.horizon]
        if not strict and len(recent) < self.keep - 1:  # (old is oldest first: its last ones hold every recent one)
            recent = old[len(old) - self.keep + 1:]
        self.samples[key] = (recent + [(step, seconds)])[-self.window:]  # (the second sample replaces the first)
        self._update(key)

    def add_to_last(self, key, seconds: float) -> None:
        """Charge more time to the newest sample of a key (what a step cost the step after it)."""
        xs = self.samples.get(key)
        if xs:
            xs[-1] = (xs[-1][0], xs[-1][1] + seconds)
            self._update(key)

    def _update(self, key) -> None:
        xs = sorted(v for _, v in self.samples[key])
        n = len(xs)
        self.median[key] = xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2

    def get(self, key, estimate: float | None = None) -> float | None:
        """The measurement; once only measured once, the lower of it and `estimate`."""
        v = self.median.get(key)
        if v is None:
            return estimate
        if estimate is not None and self.count[key] == 1:
            return min(v, estimate)
        return v

    def settled(self, key) -> bool:
        return self.count.get(key, 0) >= 2


@dataclass
class AutoK:
    ks: tuple[int, ...]  # built k values (k = 0, target-only, is always an option)
    free_drafts: bool = True  # prompt lookup (proposals cost no pass) or a draft model
    row_by_row: bool = False  # the engine verifies a batch one row at a time (cost grows with B)
    compute_bound: bool = True  # a batched verify's extra rows cost what they did at another batch (a CPU)
    free_ks: tuple[int, ...] = ()  # widths whose batch-1 verify is the target-only step's graph (OrtEngine.free_ks)
    decay: float = 0.9  # per trial (a draft token accepted or rejected): about the last 10 trials (prompt lookup)
    model_decay: float = 0.95  # a draft model's: about the last 20 (its acceptance varies less within a request)
    z: float = 0.5  # lookup decisions use the acceptance estimate less z standard errors
    z_by_stake: bool = True  # a lookup verify's z scales with what a wrong one costs (stake_z)
    z_upper: float = 1.0  # a draft model keeps learning while its estimate + z_upper SE pays at some k
    prior_weight: float = 1.0  # pseudo-trials the running estimate is worth to a new request (prompt lookup)
    model_prior_weight: float = 8.0  # a draft model's prior: 8 pseudo-trials, half-weight after 16 of its own
    chunk_guess: float = 8.0  # an unmeasured catch-up prefill chunk is guessed at this many draft passes
    copy_catch_up: bool = False  # the draft's own cache is copied from the target's (drafters.ModelDrafter.link_kv)
    refreshing: bool = False  # the last plan() returned 0 to re-measure c(0)
    explore: float = 0.02  # share of the time spent off that probes may cost
    probe_every: int = 16  # fewest steps between probes of a draft model (doubles after each failed one)
    amortize: int = 8  # R: steps a catch-up is amortised over
    refresh: int = 64  # a draft model drafting this long without a target-only step runs `refresh_steps` of them
    refresh_steps: int = 2  # the first follows a speculative step (its excess is charged there); the second is a
    # clean sample of c(0), up or down (with one, c(0) could only fall: a slower machine kept its old, low c(0))
    refresh_left: int = 0  # target-only steps of the refresh in progress still to run (dropped if another step
    # comes between: a lookup step, drafting off; the next refresh is due `refresh` steps after its first)
    chunk: int = 64  # C: the draft model's prefill chunk (a catch-up may run through it)
    whole_matches: bool = True  # hybrid: where the model pays, lookup's matches are verified whole (free_width)
    margin: float = 0.05  # model error guard: lookup's tokens over a step's must beat a verify's extra time by
    # this much; a draft model's rate must beat target-only's by this much
    handover: bool = False  # hybrid: the model's chain may hand a row over to lookup (drafters.HybridDrafter)
    price_ties: bool = True  # a k-token draft is priced at the passes its chain runs given the near-tie rate
    trim_handover: bool = True  # hybrid: a handover's lookup tokens are verified as far as they pay (handover_width)
    tie_decay: float = 0.99  # per draft position checked: about the last 100
    split_ties: bool = True  # a chain's last draft at a near-tie has an acceptance of its own (model_tokens)
    costs: Costs = field(default_factory=Costs)
    ties: list = field(default_factory=lambda: [0.0, 0.0])  # [decayed near-ties, decayed positions checked]
    tie_acc: RowAcceptance = field(default_factory=RowAcceptance)  # drafts at a near-tie, over all requests
    global_acc: dict = field(default_factory=dict)  # source -> RowAcceptance over all requests (decay 0.99)
    # draft-model probe state (per decoder: one batch drafts together)
    off_steps: int = 0
    off_seconds: float = 0.0
    interval: int = 0
    steps: int = 0
    _last: tuple = (0, 0)  # (j, bucket) of the last observed step

    # ---- estimates ---------------------------------------------------------------------------------------

    def prior(self, source: int) -> float:
        """The running estimate over all requests (one pseudo-trial at 0.5 keeps it from 0 or 1 early)."""
        g = self.global_acc.get(source) or RowAcceptance()
        return (g.accepted + 0.5) / (g.evidence + 1)

    def is_model(self, source: int) -> bool:
        """Source 0 of a drafter with a model (model or hybrid) is the model; lookup sources are n-gram lengths."""
        return source == 0 and not self.free_drafts

    def _prior_weight(self, source: int, trials: int) -> float:
        """Pseudo-trials of the running estimate in a request's estimate; the request's own evidence takes
        over as it grows."""
        g = self.global_acc.get(source)
        cap = (g.evidence if g is not None else 0.0) + 1.0  # a prior is worth no more than its own evidence
        if self.is_model(source):
            return min(self.model_prior_weight * 16 / (16 + trials), cap)
        return min(self.prior_weight * 4 / (4 + trials), cap)

    def acceptance(self, row: RowState, source: int = 0) -> float:
        """The point estimate of a_b,s."""
        acc = row.get(source)
        w = self._prior_weight(source, acc.trials)
        return (acc.accepted + w * self.prior(source)) / (acc.evidence + w)

    def confident(self, row: RowState, source: int = 0, z: float | None = None) -> float:
        """What decisions use: the estimate less `z` standard errors over its effective trials (or less the `z`
        given). A short memory is noisy, and acting on its highs (a verify right after two lucky matches) is a
        systematic loss."""
        a, acc = self.acceptance(row, source), row.get(source)
        z = self.z if z is None else z
        return max(a - z * _stderr(a, acc.evidence + self._prior_weight(source, acc.trials)), 0.0)

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
        return min(a + self.z_upper * _stderr(a, acc.trials + self._prior_weight(source, acc.trials)), 1.0)

    def verify_cost(self, j: int, B: int) -> float | None:
        """c(j, B): measured, else estimated from the nearest measured bucket (None: c(0) unmeasured here)."""
        Bb = bucket(B)
        c0 = self.costs.get(("verify", 0, Bb))
        if j == 0 or c0 is None or (Bb == 1 and j in self.free_ks):
            return c0
        if self.costs.settled(("verify", j, Bb)):
            return self.costs.get(("verify", j, Bb))
        estimate = c0 * (1.0 + 0.05 * j) * (Bb if self.row_by_row else 1)
        near = sorted((abs(math.log2(b) - math.log2(Bb)), b) for (kind, jj, b) in self.costs.median
                      if kind == "verify" and jj == j and b != Bb and self.costs.get(("verify", 0, b)))
        if near:
            b = near[0][1]
            cj = self.costs.get(("verify", j, b))
            # row by row: the verify repeats per row; batched on a CPU: each of its extra B x j rows costs what
            # one did at bucket b (compute-bound: 48 rows cost twice 16; scaling with the target-only step
            # instead priced a 16-row verify at a third of its cost, and auto explored it); on a GPU, where
            # extra rows are nearly free, it scales with the target-only step
            c0b = self.costs.get(("verify", 0, b))
            if self.row_by_row:
                estimate = cj * Bb / b
            elif self.compute_bound:
                estimate = c0 + max(cj - c0b, 0.0) * Bb / b
            else:
                estimate = c0 * cj / c0b
        return self.costs.get(("verify", j, Bb), estimate)

    def draft_cost(self, k: int, B: int) -> float | None:
        """d(B) times the passes a k-token draft is expected to run (`passes`)."""
        d = self.costs.get(("draft", 1, bucket(B)))
        return None if d is None else d * self.passes(k, B)

    def passes(self, k: int, B: int) -> float:
        """Expected passes of a k-token chained draft over B rows: each row ends at a near-tie (drafters.py, the
        margin stop), at rate t per position checked, so pass i runs while some row has not: sum over i of
        1 - (1 - (1 - t)^(i - 1))^B. k where no tie has been seen (or `price_ties` is off)."""
        tie, seen = self.ties
        if not (self.price_ties and tie > 0 and seen > 0):
            return float(k)
        go = 1.0 - tie / seen  # a row goes on after a position checked
        return sum(1.0 - (1.0 - go ** i) ** B for i in range(k))

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

    def catch_up(self, gap: int, B: int) -> tuple[float, str]:
        """The cheaper way to show a draft model `gap` committed tokens it missed (the largest gap of the batch's
        rows; they catch up together) -> (seconds, "pass" | "chunk"): ceil(gap / 2) draft calls that each
        rewrite two tokens, or ceil(gap / chunk) prefill chunks. Each is costed per call, measured; unmeasured,
        a call is guessed at one draft pass (it is one or two passes, or the smallest built k's draft) and a chunk
        at `chunk_guess` passes, and with no draft pass measured at this bucket the choice is made in those
        units (seconds 0). A call costs about the same whatever it holds: costing a one-token gap per token
        through a 64-token chunk (42 ms, as measured) made every later gap look dear, and kept a draft model
        off for the rest of its request. A draft whose cache is copied from the target's: (gap x B x the
        measured seconds per row-position copied, "copy")."""
        if gap <= 0:
            return 0.0, "pass"
        if self.copy_catch_up:  # a copy of the target's cache rows: measured per row-position copied, at most
            return gap * B * self.costs.get(("catch_up", "copy", bucket(B)), 0.0), "copy"  # B rows (free unmeasured)
        Bb, d = bucket(B), self.draft_cost(1, B)
        unit = 1.0 if d is None else d
        per_pass = self.costs.get(("catch_up", "pass", Bb), unit)
        per_chunk = self.costs.get(("catch_up", "chunk", Bb), self.chunk_guess * unit)
        by_pass, by_chunk = -(-gap // 2) * per_pass, -(-gap // self.chunk) * per_chunk
        way = "pass" if by_pass <= by_chunk else "chunk"
        return (0.0 if d is None else min(by_pass, by_chunk)), way

    @staticmethod
    def _lookup_tokens(a: list[float], lens: list[int], j: int) -> float:
        """Expected committed tokens of verifying free proposals (lens, acceptances a) at width j."""
        return sum(expected_tokens(ai, min(n, j)) for ai, n in zip(a, lens))

    def _lookup_rate(self, B: int, a: list[float], lens: list[int], j: int) -> float:
        """Expected committed tokens per second of verifying free proposals (lens, acceptances a) at width j."""
        return self._lookup_tokens(a, lens, j) / self.verify_cost(j, B)

    def _model_rate(self, B: int, rows: list[RowState], k: int, catch_up: float, estimate=None,
                    a_tie: float | None = None) -> float:
        """Expected committed tokens per second of a k-token model draft (its catch-up amortised), at each row's
        point estimate (or `estimate(row)`; a_tie: model_tokens')."""
        estimate = estimate or self.acceptance
        return sum(self.model_tokens(estimate(r), k, a_tie) for r in rows) / (
            self.draft_cost(k, B) + self.verify_cost(k, B) + catch_up / self.amortize)

    # ---- choices -----------------------------------------------------------------------------------------

    def plan(self, B: int, rows: list[RowState], missing: int = 0, free: bool | None = None) -> int:
        """The k to draft before the step (lookup: the largest, its proposals are free; `width` then picks
        what to verify). missing: the most committed tokens a row's draft model has not seen (its catch-up).
        free: this step's proposals cost no pass (default: the drafter's kind; a hybrid step where every row
        matched lookup)."""
        self.steps += 1
        left = self.refresh_left if self.refreshing else 0  # a refresh goes on only right after its own steps
        self.refreshing, self.refresh_left = False, 0
        if self.free_drafts if free is None else free:
            return max(self.ks)
        c0 = self.verify_cost(0, B)
        if c0 is None:
            return 0  # measure the target-only step at this batch size first
        kmin = min(self.ks)
        if self.draft_cost(1, B) is None:  # the draft's cost at this bucket is unknown: one probe measures it
            return kmin
        catch_up = self.catch_up(missing, B)[0]
        fresh = any(r.spec_steps == 0 for r in rows)
        kmin = self.probe_k(B, c0, catch_up)
        best, best_rate = 0, (1 + self.margin) * len(rows) / c0
        for k in self.ks:
            if fresh and k > kmin:
                continue  # a request's first speculative step is a probe (the smallest k that could pay)
            rate = self._model_rate(B, rows, k, catch_up)
            if rate > best_rate:
                best, best_rate = k, rate
        if not best:  # too little evidence to rule drafting out: keep learning at the k whose upper bound pays most
            up = {k: self._model_rate(B, rows, k, catch_up, self.upper) for k in self.ks if not (fresh and k > kmin)}
            k = max(up, key=up.get)
            if up[k] > best_rate:
                best = k
        if best:
            self.off_steps = self.off_seconds = 0
            self.interval = self.probe_every
            if left or self.steps - self.costs.when.get(("verify", 0, bucket(B)), 0) >= self.refresh:
                self.refresh_left = (left or self.refresh_steps) - 1
                self.refreshing = True  # (a hybrid then runs no lookup step instead: batch.py)
                return 0  # the reference cost is stale: re-measure it (drafting compares against it)
            return best
        return self._maybe_probe(B, rows, kmin, c0, catch_up)

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
        return self._model_rate(B, [RowState()], kmin, catch_up, self.upper) > (1 + self.margin) / c0

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
        if all(self.model_tokens(1.0, kk, 1.0) / (self.draft_cost(kk, B) + self.verify_cost(kk, B)) <= 1 / c0
               for kk in self.ks):
            return 0  # cannot pay even if every draft were accepted
        cost = self.draft_cost(k, B) + self.verify_cost(k, B)
        loss = cost + catch_up - c0 * sum(self.model_tokens(self.acceptance(r), k) for r in rows) / len(rows)
        if loss <= 0:  # the point estimate says it pays, only its confidence bound does not yet: more evidence
            return k
        if self.off_steps >= self.interval and loss <= self.explore * self.off_seconds:
            self.off_steps = self.off_seconds = 0
            self.interval *= 2  # reset to probe_every once drafting pays again
            return k
        return 0

    def cap(self, row: RowState, source: int, B: int = 1) -> int:
        """The most a row may verify from a source it has shown nothing for yet: the widest built k whose
        measured verify costs no more than the smallest's (+5%), else the smallest (its first verify is a cheap
        probe; one step of evidence lifts the cap)."""
        if row.get(source).trials:
            return max(self.ks)
        kmin, Bb = min(self.ks), bucket(B)
        c = self.verify_cost(kmin, B)
        if c is None:
            return kmin
        return max(k for k in self.ks if k == kmin or (self.costs.settled(("verify", k, Bb))
                                                        and self.verify_cost(k, B) <= (1 + self.margin) * c))

    def width(self, B: int, rows: list[RowState], lens: list[int], sources: list[int]) -> int:
        """For free proposals (lens[i] tokens from source sources[i] for rows[i], already capped): the verify
        width."""
        c0 = self.verify_cost(0, B)
        if c0 is None or not any(lens):
            return 0
        n = len(rows)
        best, best_rate = 0, n / c0
        for j in sorted(self.ks):
            cj = self.verify_cost(j, B)
            zj = self.stake_z(cj, c0)
            a = [self.confident(r, s, zj) for r, s in zip(rows, sources)]
            tokens = self._lookup_tokens(a, lens, j)
            # the tokens it promises over target-only's must beat its extra time by `margin`
            if tokens / cj > best_rate and tokens - n > (1 + self.margin) * n * (cj / c0 - 1):
                best, best_rate = j, tokens / cj
        return best

    def free_width(self, B: int, rows: list[RowState], lens: list[int], sources: list[int],
                   missing: int = 0) -> int | None:
        """Hybrid, every row has a lookup proposal (lens[i] tokens from source sources[i], uncapped): None where
        the model drafts instead, else the free step's verify width: -1 for `width`'s choice over capped
        proposals (prompt lookup's own rule, target-only where it picks 0), or a built k that verifies every
        row's match whole.
        - The model pays (its best rate, as `plan` costs it, beats target-only's by `margin`): the free step
          replaces a model step that would run its draft passes and a verify anyway, so the matches are verified
          whole, uncapped, where their promise at each row's upper bound (`upper`) is at least the model's. A
          match comes in runs (text being copied): along the outputs, a 2-gram match's later tokens are
          accepted 0.55-0.90 of the time against 0.42-0.52 for its first, so the geometric model at the
          first-token rate (what `confident` gives, shadow checks included) sent such matches to the model; a
          row whose matches keep failing still goes to the model (its upper bound falls).
        - Otherwise the free step's rate at the width `width` picks (a width its guard refuses must not win)
          against the model's. Unmeasured costs: free."""
        c0, d = self.verify_cost(0, B), self.draft_cost(1, B)
        if c0 is None or d is None:
            return -1
        catch_up = self.catch_up(missing, B)[0]
        model = max(self._model_rate(B, rows, k, catch_up) for k in self.ks)
        if self.whole_matches and model > (1 + self.margin) * len(rows) / c0:
            j = min((k for k in self.ks if k >= max(lens)), default=max(self.ks))
            whole = self._lookup_rate(B, [self.upper(r, s) for r, s in zip(rows, sources)], lens, j)
            return j if whole >= model else None
        j = self.width(B, rows, lens, sources)
        free = self._lookup_rate(B, [self.confident(r, s) for r, s in zip(rows, sources)], lens, j) if j \
            else len(rows) / c0
        return -1 if free >= model else None

    def handover_width(self, B: int, rows: list[RowState], heads: list[int], lens: list[int], sources: list[int],
                       passes: int) -> int:
        """A model step whose chain handed rows over to lookup (drafters.HybridDrafter): row i's proposal is
        heads[i] model tokens, then lens[i] - heads[i] of lookup's (source sources[i]). Its `passes` draft passes
        are spent, not its verify: -> the verify width (a built k holding every row's model tokens; rows cut to it)
        with the most expected tokens per second of the whole step, the model's tokens at each row's point
        estimate, lookup's at its bound (`confident` at the width's stake). Without it a handover after one
        model token verified lookup's rest of k whole: a width-8 verify (1.48 target-only steps) for about 2
        tokens. Lossless: only one-hot lookup tokens are cut (never a model token, which may have been sampled),
        before the verify."""
        d, c0 = self.draft_cost(1, B), self.verify_cost(0, B)
        longest = max(lens)
        if d is None or c0 is None or longest <= max(heads):
            return longest
        sunk = passes * d
        best, best_rate = longest, -1.0
        for j in sorted(k for k in self.ks if k >= max(heads)):
            cj = self.verify_cost(j, B)
            zj = self.stake_z(cj, c0)
            tokens = 0.0
            for r, h, n, s in zip(rows, heads, lens, sources):
                a = self.acceptance(r)
                m, rest = min(h, j), min(n, j) - min(h, j)
                tokens += expected_tokens(a, m) + (a ** m * (expected_tokens(self.confident(r, s, zj), rest) - 1.0)
                                                   if rest > 0 else 0.0)
            if tokens / (sunk + cj) > best_rate:
                best, best_rate = min(j, longest), tokens / (sunk + cj)
            if j >= longest:
                break
        return best

    def lookup_row_beats_model(self, row: RowState, source: int, n: int, k: int) -> bool:
        """A hybrid step that drafts with the model anyway: does this row's lookup proposal (n tokens) promise
        more committed tokens than the model's k (the step costs the same either way)?"""
        return expected_tokens(self.confident(row, source), min(n, k)) > self.model_tokens(self.acceptance(row), k)

    # ---- measurements ------------------------------------------------------------------------------------

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
            if verify_s < c0:  # even after a switch it was faster: c(0) was too high (it is re-measured)
                self.costs.observe(("verify", 0, Bb), verify_s, t, strict)
            self.costs.when[("verify", 0, Bb)] = t
        else:
            self.costs.observe(("verify", j, Bb), verify_s, t, strict)
        if draft_passes:
            self.costs.observe(("draft", 1, Bb), draft_s / draft_passes, t)
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

    def end_step(self, k: int, rows: list[RowState]) -> None:
        if k:
            for r in rows:
                r.spec_steps += 1


def _stderr(a: float, n: float) -> float:
    """The standard error of an acceptance estimate a over n (effective) trials."""
    return math.sqrt(a * (1 - a) / (n + 1))
