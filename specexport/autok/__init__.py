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
             x 16 / (16 + its trials), times the chance that the request is like the others given its counts
             (`fits_prior`: a mixture with `prior_doubt` = 0.05 on an acceptance of its own, uniform; two
             rejections and nothing accepted leave a 0.98 prior). It starts from the other requests, then
             follows its own. A draft model's acceptance varies less between requests than lookup's, and with
             a weak prior one early rejection (3 trials: 0.69 against 0.98 over all requests) turned a good
             draft off for the rest of its request. Lookup's verify decisions use a lower confidence bound
             (less `z` = 0.5 standard errors over the effective trials): its evidence is mostly one-token
             shadow checks, a short memory of them is noisy, and acting on its highs is a loss. With
             pre-packed verifies a full standard error was too timid (alternating A/B, 24 prompts x 2: auto /
             best fixed k 0.95 -> 0.98, worst prompt / target-only 0.97 -> 0.99). At a verify width j the bound
             is less z min(1, c(j) / c(0) - 1) standard errors (`stake_z`): caution in proportion to what a
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
    The model hands a row over to lookup mid-draft (drafters.HybridDrafter) only where that pays
    (`handover_pays`, `price_handover`): after j of k passes, lookup's n tokens promise E(a, j) + a^j (E(a_s, n)
    - 1) tokens for j d + c(j + n), against E(a, k) for k d + c(k) drafting on (a_s at the point estimate; the
    model's a). Every match of min_match tokens took the row over before: chat and rewritten code lost chains of
    11 model drafts accepted 0.99 of the time to lookup continuations mostly rejected (replayed, noise 0.1, 4
    seeds: +4.4% and +1.7% on the bench and held-out prompts; real runs +5.4%, README "Hybrid drafting").
    Where the model hands a row over, its j tokens count for
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
    A request's first speculative step is at most the probe k while the running estimate over earlier
    requests is thin (no evidence yet: a cheap probe), the smallest built k that could pay if every draft were
    accepted (without pre-packing a k=2 verify costs two target-only steps and only k=8 can pay). Once that
    estimate has the evidence to be worth its full `model_prior_weight` (`prior_settled`), the first step
    drafts at the k it promises, as the request's next steps do until its own trials take over: the probe
    spent a step of every short request at k = 2 (replayed, the hybrid at auto +1.2% pre-packed, +0.7%
    without). The price is one wide step where a request's drafts all fail after many good requests: in
    simulation (tests/test_autok.py's costs, draft pass 0.2-0.45 c(0)) such a request ran 0.956-0.958x
    target-only against 0.964-0.969x with the probe (`fits_prior` ends its drafting after two failed steps;
    with the prior's full weight, 0.92-0.93x and 0.93-0.94x). While the point estimate says no k pays but its upper
    bound (+ `z_upper` standard errors over all the request's trials and its prior's) says one does, the k
    that pays most at the upper bound drafts (evidence is gathered, not assumed; with only the smallest k
    allowed here, a draft whose smallest k cannot pay was turned off for the rest of a request by two
    rejections; a request's first step learns at most at the probe k, its prior settled or not). A new
    request's prompt is prefilled into the draft at admission (as at a fixed k) unless the measured costs say
    the probe k (once the prior is settled: any k) does not pay even at a fresh request's upper bound, with
    the catch-up the batch's running rows need first; otherwise the draft catches up if drafting turns on.
    While off, the counts stay frozen and a probe (the probe k) runs only if the draft could pay at all
    (if every draft were accepted, some k would beat target-only, at the lowest median each cost has had:
    `could_pay`; a pass cost with one sample rules nothing out), and then either
      - the point estimate says it pays (an expected gain; only the confidence bound is not convinced yet), or
      - its expected loss fits `explore` (2%) of the time spent off since the last probe, and at least
        `probe_every` steps have passed, doubling after each such probe.
    So in N steps off at acceptance too low to pay there are at most 1 + log2(N / probe_every) probes,
    costing at most 2% of that time; the upper-bound steps above come on top, and each one that pays restarts
    the probe interval (their number is bounded by how fast the bound tightens: a few steps per request for
    a draft that does not pay, see tests/test_autok.py).
  Costs are the median of the last 5 samples within 32 steps of the newest (a passing stall moves a median
  less than a moving average, and an old sample does not outvote a new one), but of no fewer than the last 3
  (a width run rarely is not set by one stall until it runs again); c(0)'s, of an even number, is the lower
  middle one (a stall only slows a step). A target-only step right after
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
  only the second can raise c(0) (once c(0) has two samples; before, the first replaces its set-up one). With
  one step every 32, c(0) could only fall: over the fp32 SmolLM2 target, three decoders on one engine in one
  run came to price c(8) at 1.55, 1.61 and 2.34 c(0) (stop 46).
  A refresh drops c(0)'s older samples (so that a slower machine is followed at once), so its second step is
  often c(0)'s only sample until the next refresh, and one stall there set c(0) for 64 steps. Where it lands
  more than `refresh_tol` (10%) above the c(0) believed before it, a check runs one more clean target-only step
  (where other steps came between, at the next step the model drafts, after a step that pays the graph switch
  and is not counted), and c(0) is the median of the refresh's samples, of two the lower: a stall is
  outvoted, a machine that really slowed down measures the same twice (a faster sample is no stall). Stop 48
  saw a refresh's c(0) of 22.4 and 41.7 ms read 32.1 (their mean), where every step ran about 22: a k = 8
  verify looked cheaper than a target-only step for 64 steps. While c(0) has only its first sample (set-up
  heavy: 31.8 against 21.7 ms), the first refresh comes after `refresh_first` (8) steps, not 64.
  A width not run for `refresh` steps is stale: it is priced at most on the line through c(0) and the most
  recently measured other width, so it runs again where that pays, and its new sample replaces the old ones.
  Before, a burst of stalls priced c(8) at 2.7 c(0) (it ran at 1.4), and auto ran k = 4 for the rest of the run
  without measuring k = 8 again (stop 48: 0.959 of fixed k = 8 over 24 prompts). A draft pass cost not
  measured for `refresh` steps is stale too: its new sample (a probe's) replaces the old ones. Before
  `could_pay` judged at the lowest costs seen, a burst of CPU contention priced d at 1.35 c(0) (it runs at
  0.40), no k could pay even if every draft were accepted, so no probe ran, and the model stayed off for good
  (stop 49); now the probes re-measure it within their budget.
Why it holds: a lookup step is a verify only when its expected rate beats the measured target-only rate;
mistakes cost one verify each and teach a_b; a draft model is tried at the probe k while its evidence (its
own and the running estimate's) is thin, then only within the 2% budget.
The README ("Adaptive k") gives the measurements. Known approximation:
a request's own trials also feed the running estimate that is its prior, so for the first requests the
upper bound's evidence is overstated (by up to 2x in trials).
"""

from .acceptance import RowAcceptance, RowState, acceptance_mle, expected_tokens, matched
from .controller import AutoK
from .costs import Costs, bucket

__all__ = ["AutoK", "Costs", "RowAcceptance", "RowState", "acceptance_mle", "bucket", "expected_tokens", "matched"]
