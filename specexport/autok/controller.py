"""AutoK: the settings and state of adaptive k, one per decoder. Its methods live by concern: acceptance.Estimates,
costs.Pricing, drafting.ModelPlan (a draft model), lookup.LookupWidths (prompt lookup, the hybrid),
observe.Observations (measurements)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .acceptance import Estimates, RowAcceptance
from .costs import Costs, Pricing
from .drafting import ModelPlan
from .lookup import LookupWidths
from .observe import Observations


@dataclass
class AutoK(Observations, LookupWidths, ModelPlan, Pricing, Estimates):
    """Adaptive k for one decoder: the rule is in the package's docstring (specexport/autok/__init__.py). A batch
    asks `plan` before a step (a draft model) or `width` / `free_width` / `handover_width` after lookup proposes,
    then reports the step through the `observe_*` methods and `end_step`."""

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
    prior_doubt: float = 0.05  # P(a request's drafts are unlike the other requests'), before its evidence (fits_prior)
    trust_prior: bool = True  # once that prior is settled, a request's first step drafts at its k (not the probe k)
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
    refresh_first: int = 8  # ... or this long, while c(0) has only its first, set-up heavy sample (stop 48: 31.8
    # against 21.7 ms, believed for the decoder's first 64 steps)
    refresh_tol: float = 0.1  # a refresh's last sample this far from the c(0) believed is checked by one more step
    refresh_ref: float = 0.0  # c(0) before the refresh's last step (what its sample is checked against)
    refresh_last: int = 0  # the step stamp of the last refresh's last step
    refresh_checked: bool = False  # the last refresh has run its check
    checking: bool = False  # the last plan() returned 0 for a check (ModelPlan._refresh_moved)
    chunk: int = 64  # C: the draft model's prefill chunk (a catch-up may run through it)
    whole_matches: bool = True  # hybrid: where the model pays, lookup's matches are verified whole (free_width)
    margin: float = 0.05  # model error guard: lookup's tokens over a step's must beat a verify's extra time by
    # this much; a draft model's rate must beat target-only's by this much
    handover: bool = False  # hybrid: the model's chain may hand a row over to lookup (drafters.HybridDrafter)
    price_ties: bool = True  # a k-token draft is priced at the passes its chain runs given the near-tie rate
    trim_handover: bool = True  # hybrid: a handover's lookup tokens are verified as far as they pay (handover_width)
    price_handover: bool = True  # hybrid: a row is handed over only where lookup's rest pays more (handover_pays)
    handover_estimate: str = "point"  # lookup's acceptance in handover_pays: "point", "confident" or "upper"
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

    def __post_init__(self):
        if not 0.0 <= self.prior_doubt < 1.0:
            raise ValueError(f"AutoK.prior_doubt is {self.prior_doubt}: a probability in [0, 1) (default 0.05)")
        for name in ("refresh", "refresh_first", "refresh_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"AutoK.{name} is {getattr(self, name)}: it counts steps, at least 1 (defaults: "
                                 "refresh 64, refresh_first 8, refresh_steps 2)")
