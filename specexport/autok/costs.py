"""Step costs: measured seconds per (kind, width, batch bucket), and what AutoK prices a step at from them: c(j, B),
d(B) times the passes a chained draft runs, the catch-up u(g, B)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def bucket(B: int) -> int:
    """Batch sizes share cost measurements per power of two (1, 2, 4, 8, 16, ...)."""
    return 1 << max(B - 1, 0).bit_length()


@dataclass
class Costs:
    """Measured seconds per key: the median of the last `window` samples taken within `horizon` steps of the
    newest (a passing stall moves a median less than a moving average; an old sample does not outvote a new
    one), but never fewer than the last `keep` (at most `window`): a width auto seldom runs is not set by one
    sample, so one stall does not make it look dear until it is run again (stop 47: prompt lookup ended a run
    believing c(4) = 2.45 c(0), where fixed k = 4 ran 1.08 c(0) a step). A `strict` sample (a draft model's
    c(0) refresh, AutoK.refresh) keeps to the horizon alone: a slower machine moves c(0) at the first refresh.
    The first sample of a key is provisional (it includes set-up). A `low` key's median of an even number of
    samples is the lower middle one, not the mean of the two: AutoK's c(0), whose samples are steady target-only
    steps, where a stall only slows a step and the mean of two, one a stall, is half a stall (stop 48: a refresh's
    22.4 and 41.7 ms read 32.1). Other keys keep the mean: half of a width's samples may carry a graph switch's
    charge (AutoK's observe_costs), which is a cost, not noise."""

    window: int = 5
    horizon: int = 32
    keep: int = 3
    samples: dict = field(default_factory=dict)  # key -> [(step, seconds)], oldest first
    count: dict = field(default_factory=dict)
    when: dict = field(default_factory=dict)  # key -> the step it was last measured at
    median: dict = field(default_factory=dict)  # key -> the median of its samples (kept current)
    low: set = field(default_factory=set)  # keys whose median of an even number is the lower middle
    floor: dict = field(default_factory=dict)  # key -> the lowest median it had before its newest sample (one
    # behind, so that a verify's sample has had its graph-switch charge, `add_to_last`): AutoK.could_pay

    def observe(self, key, seconds: float, step: int = 0, strict: bool = False, low: bool = False) -> None:
        if low:
            self.low.add(key)
        n = self.count.get(key, 0)
        if key in self.median:
            self.floor[key] = min(self.floor.get(key, self.median[key]), self.median[key])
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
        self.median[key] = xs[(n - 1) // 2] if n % 2 or key in self.low else (xs[n // 2 - 1] + xs[n // 2]) / 2

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

    def lowest(self, key) -> float:
        """The lowest median the key has had (its floor, or its median now if lower)."""
        v = self.median[key]
        return min(self.floor.get(key, v), v)


class Pricing:
    """AutoK's prices (its fields: controller.AutoK)."""

    def verify_cost(self, j: int, B: int) -> float | None:
        """c(j, B): measured, else estimated from the nearest measured bucket (None: c(0) unmeasured here)."""
        Bb = bucket(B)
        c0 = self.costs.get(("verify", 0, Bb))
        if j == 0 or c0 is None or (Bb == 1 and j in self.free_ks):
            return c0
        if self.costs.settled(("verify", j, Bb)):
            v = self.costs.get(("verify", j, Bb))
            if self.stale(("verify", j, Bb)):  # not run for `refresh` steps: a stall may have priced it out
                line = self._fresh_line(j, Bb, c0)
                v = v if line is None else min(v, line)
            return v
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

    def stale(self, key) -> bool:
        """A draft model's measured cost not re-measured for `refresh` steps (auto has not run that width, or
        drafted, since).
        Not prompt lookup's: it picks a width per step from the proposals, and a line through c(0) that prices a
        width low (without pre-packing c(2) = 1.00 c(0), c(8) = 1.19) only spent verifies there (replayed: its
        lowest prompt 0.990 -> 0.977 at the worst seed)."""
        return not self.free_drafts and self.costs.settled(key) \
            and self.steps - self.costs.when.get(key, self.steps) >= self.refresh

    def _fresh_line(self, j: int, Bb: int, c0: float) -> float | None:
        """c(j) on the line through c(0) and the most recently measured other width that is not stale (None: there
        is none). Stop 48: a burst of stalls priced c(8) at 2.7 c(0) (it runs at 1.4), so auto ran k = 4 and never
        measured k = 8 again (0.959 of fixed k = 8 over 24 prompts). A stale width is priced at most on this line:
        it is run again where that pays, and its new sample replaces the old ones (AutoK.observe_costs)."""
        fresh = [(self.costs.when[k], k[1]) for k in self.costs.median
                 if k[0] == "verify" and k[2] == Bb and k[1] not in (0, j) and not self.stale(k)
                 and self.costs.settled(k)]
        if not fresh:
            return None
        jj = max(fresh)[1]
        return c0 + max(self.costs.get(("verify", jj, Bb)) - c0, 0.0) * j / jj

    def draft_cost(self, k: int, B: int) -> float | None:
        """d(B) times the passes a k-token draft is expected to run (`passes`)."""
        d = self.costs.get(("draft", 1, bucket(B)))
        return None if d is None else d * self.passes(k, B)

    def could_pay(self, B: int, c0: float) -> bool:
        """Could a draft model pay at all here: would some k beat target-only if every draft were accepted, at the
        lowest median each cost has had (`Costs.floor`)? Where not, no probe runs. At the costs as believed, a
        burst of CPU contention (another process on the 2-core host) priced a pass at 1.35 c(0), where it runs at
        0.40: no k could pay, so no probe ran and the model stayed off for the rest of the run (217 target-only
        steps in a row). At the floor, probes run within the exploration budget (ModelPlan._maybe_probe, which
        prices their loss at the costs as believed), and a stale pass cost's new sample replaces the old ones
        (observe_costs). A pass cost with one sample (set-up heavy, perhaps) rules nothing out."""
        key, Bb = ("draft", 1, bucket(B)), bucket(B)
        if not self.costs.settled(key):
            return True
        d = self.costs.lowest(key)
        for k in self.ks:
            v = self.verify_cost(k, B)
            if ("verify", k, Bb) in self.costs.median:
                v = min(v, self.costs.lowest(("verify", k, Bb)))
            if self.model_tokens(1.0, k, 1.0) / (d * self.passes(k, B) + v) > 1 / c0:
                return True
        return False

    def passes(self, k: int, B: int) -> float:
        """Expected passes of a k-token chained draft over B rows: each row ends at a near-tie (drafters.py, the
        margin stop), at rate t per position checked, so pass i runs while some row has not: sum over i of
        1 - (1 - (1 - t)^(i - 1))^B. k where no tie has been seen (or `price_ties` is off)."""
        tie, seen = self.ties
        if not (self.price_ties and tie > 0 and seen > 0):
            return float(k)
        go = 1.0 - tie / seen  # a row goes on after a position checked
        return sum(1.0 - (1.0 - go ** i) ** B for i in range(k))

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

