"""Prompt lookup's verify widths: its proposals cost no pass, so the width is chosen after seeing them (`width`,
`cap`), and a hybrid's choices between lookup and the model (`free_width`, `handover_width`,
`lookup_row_beats_model`)."""

from __future__ import annotations

from .acceptance import RowState, expected_tokens
from .costs import bucket


class LookupWidths:
    """AutoK's choices for prompt lookup and the hybrid (its fields: controller.AutoK)."""

    @staticmethod
    def _lookup_tokens(a: list[float], lens: list[int], j: int) -> float:
        """Expected committed tokens of verifying free proposals (lens, acceptances a) at width j."""
        return sum(expected_tokens(ai, min(n, j)) for ai, n in zip(a, lens))

    def _lookup_rate(self, B: int, a: list[float], lens: list[int], j: int) -> float:
        """Expected committed tokens per second of verifying free proposals (lens, acceptances a) at width j."""
        return self._lookup_tokens(a, lens, j) / self.verify_cost(j, B)

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

    def handover_pays(self, row: RowState, source: int, j: int, n: int, k: int, B: int = 1) -> bool:
        """A hybrid chain after j of its k model drafts, where lookup offers the row's next n tokens (source
        `source`; drafters.HybridDrafter's handover): does handing the row over promise more committed tokens per
        second of the step than drafting on? Handed over: E(a, j) + a^j (E(a_s, n) - 1) tokens for j passes and
        the verify that holds j + n; drafting on: the model's k-token chain for k passes and a width-k verify (a,
        the model's point estimate; a_s, lookup's at `handover_estimate`). Without it every match of min_match
        tokens took the row over: where the model's drafts were accepted 0.99 of the time and lookup's mostly
        rejected (chat, code that is rewritten rather than copied), chains of 11 became steps of 2 to 4.
        Unmeasured costs, or `price_handover` off: hand over (the rule before)."""
        d, ck = self.draft_cost(1, B), self.verify_cost(k, B)
        if not self.price_handover or d is None or ck is None:
            return True
        a = self.acceptance(row)
        a_s = (self.acceptance if self.handover_estimate == "point" else getattr(self, self.handover_estimate))(
            row, source)
        width = min((kk for kk in self.ks if kk >= j + n), default=max(self.ks))
        handed = expected_tokens(a, j) + a ** j * (expected_tokens(a_s, n) - 1.0)
        return handed / (j * d + self.verify_cost(width, B)) >= self.model_tokens(a, k) / (k * d + ck)

    def lookup_row_beats_model(self, row: RowState, source: int, n: int, k: int) -> bool:
        """A hybrid step that drafts with the model anyway: does this row's lookup proposal (n tokens) promise
        more committed tokens than the model's k (the step costs the same either way)?"""
        return expected_tokens(self.confident(row, source), min(n, k)) > self.model_tokens(self.acceptance(row), k)
