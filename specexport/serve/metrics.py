"""Serving metrics, counted once and exported by every server (the OpenAI server's /metrics, Triton's metrics
endpoint through the python backend's metrics API).

The speculation counters follow vLLM's spec-decode metrics (vllm:spec_decode_num_drafts, _num_draft_tokens,
_num_accepted_tokens, _num_accepted_tokens_per_pos). Counts are per request row: a batched step over 4 rows is
4 drafts. They are added when a request finishes (completed, stopped, cancelled or failed), from its
GenerationStats, so a long request shows up at its end. Names carry the `specexport_` prefix:

  specexport_requests_total{finish_reason}               finished requests (stop, length, cancelled, error)
  specexport_prompt_tokens_total / _generation_tokens_total
  specexport_spec_decode_num_drafts_total                row-steps that verified at least one draft token
  specexport_spec_decode_num_draft_tokens_total          draft tokens verified
  specexport_spec_decode_num_accepted_tokens_total       draft tokens accepted
  specexport_spec_decode_num_accepted_tokens_per_pos_total{position="i"}   accepted at draft position i (1..k)
  specexport_steps_total{k}                              row-steps by verify width (k="0": target-only)
  specexport_num_requests_running / _waiting             gauges, read when scraped
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from ..request import GenerationStats

PREFIX = "specexport_"


@dataclass(frozen=True)
class Sample:
    """One exported value: name (with PREFIX, without a _total suffix), kind, help, labels, value."""

    name: str
    kind: str  # "counter" | "gauge"
    help: str
    labels: tuple[tuple[str, str], ...]
    value: float


COUNTERS = {  # name -> help (labels, where any, are in the name's samples)
    "requests": "Finished requests by finish reason (stop, length, cancelled, error).",
    "prompt_tokens": "Prompt tokens of finished requests.",
    "generation_tokens": "Generated tokens of finished requests.",
    "spec_decode_num_drafts": "Row-steps that verified at least one draft token.",
    "spec_decode_num_draft_tokens": "Draft tokens verified.",
    "spec_decode_num_accepted_tokens": "Draft tokens accepted.",
    "spec_decode_num_accepted_tokens_per_pos": "Draft tokens accepted at each draft position (1..k).",
    "steps": "Row-steps by verify width k (0: a target-only step).",
}
GAUGES = {
    "num_requests_running": "Requests holding a cache row.",
    "num_requests_waiting": "Requests queued for a free row.",
}


class SpecMetrics:
    """Thread-safe counters fed by the batcher's thread; `samples()` reads them (and the gauges) for export."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts: Counter = Counter()  # (name, labels) -> value
        self.gauges: dict[str, Callable[[], float]] = {}  # name -> reader, set by the batcher

    def observe(self, stats: GenerationStats | None, finish_reason: str | None) -> None:
        """A finished request: add its stats (None when it failed before it ran)."""
        with self._lock:
            c = self._counts
            c[("requests", (("finish_reason", finish_reason or "error"),))] += 1
            if stats is None:
                return
            c[("prompt_tokens", ())] += stats.prompt_tokens
            c[("generation_tokens", ())] += stats.new_tokens
            c[("spec_decode_num_drafts", ())] += sum(stats.proposed_hist[1:])
            c[("spec_decode_num_draft_tokens", ())] += stats.drafted
            c[("spec_decode_num_accepted_tokens", ())] += stats.accepted
            for i, n in enumerate(stats.accepted_per_pos, 1):
                c[("spec_decode_num_accepted_tokens_per_pos", (("position", str(i)),))] += n
            for k, n in stats.k_steps.items():
                c[("steps", (("k", str(k)),))] += n

    def value(self, name: str, **labels: str) -> float:
        with self._lock:
            return self._counts[(name, tuple(sorted(labels.items())))]

    def samples(self) -> list[Sample]:
        with self._lock:
            counts = sorted(self._counts.items())
        out = [Sample(PREFIX + name, "counter", COUNTERS[name], labels, float(v)) for (name, labels), v in counts]
        for name, read in self.gauges.items():
            out.append(Sample(PREFIX + name, "gauge", GAUGES[name], (), float(read())))
        return out
