"""`layers:` draft specs (torch-free: the CLI and `specexport inspect` read them without torch).

  layers:0-11,14,20-29        keep these target layers (0-based, ranges inclusive)
  layers:auto                 the set models/layer_search.py chooses on calibration text
  layers:0-11:int8[:b32:sym]  the same layers, their linears weight-only quantized (models/quant.py)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import LAYERS_PREFIX, QUANT_PREFIX, QuantSpec
from ..errors import SpecExportError

AUTO = "auto"
USAGE = ("use layers:auto or layers:<list> with 0-based target layers and inclusive ranges (e.g. layers:0-11,14,"
         "20-29), optionally followed by :int8 or :int4 (e.g. layers:auto:int8)")


def is_layers_spec(spec: object) -> bool:
    return isinstance(spec, str) and spec.startswith(LAYERS_PREFIX)


@dataclass(frozen=True)
class LayerSpec:
    keep: tuple[int, ...] | None  # None: auto (chosen on calibration text)
    quant: str | None = None  # "quant:int8[...]" / "quant:int4[...]" for a quantized variant, None: float

    @classmethod
    def parse(cls, spec: str) -> "LayerSpec":
        body = spec.removeprefix(LAYERS_PREFIX)
        layers, _, rest = body.partition(":")
        quant = None
        if rest:
            quant = QUANT_PREFIX + rest
            QuantSpec.parse(quant)  # a bad quantization suffix fails here
            for field in ("smooth", "head"):  # (quantized_skip never smooths, and its head is the target's own)
                if any(f.startswith(field) for f in rest.split(":")):
                    raise SpecExportError(f"draft {spec!r}: :{field} is for quant: copies, not layers: drafts; "
                                          "drop it")
        if layers == AUTO:
            return cls(None, quant)
        keep: list[int] = []
        for part in layers.split(","):
            lo, dash, hi = part.strip().partition("-")
            if not lo.isdigit() or (dash and not hi.isdigit()):
                raise SpecExportError(f"draft {spec!r}: {part.strip() or '(empty)'!r} is not a layer or a range; "
                                      f"{USAGE}")
            a, b = int(lo), int(hi) if dash else int(lo)
            if b < a:
                raise SpecExportError(f"draft {spec!r}: range {part.strip()!r} runs backwards; write it low-high")
            keep.extend(range(a, b + 1))
        if len(set(keep)) != len(keep):
            raise SpecExportError(f"draft {spec!r} names a layer twice: list each kept layer once")
        return cls(tuple(sorted(keep)), quant)

    def check(self, num_layers: int, spec: str) -> tuple[int, ...]:
        """The kept layers, checked against the target's layer count."""
        assert self.keep is not None
        bad = [i for i in self.keep if i >= num_layers]
        if bad:
            raise SpecExportError(f"draft {spec!r} keeps layer {bad[0]}, but the target has {num_layers} layers "
                                  f"(0-{num_layers - 1}): choose layers within 0-{num_layers - 1}")
        if len(self.keep) == num_layers and self.quant is None:
            raise SpecExportError(f"draft {spec!r} keeps all {num_layers} layers, so it is the target itself: skip "
                                  "some layers, or add :int8 / :int4 for a quantized copy")
        return self.keep

    def name(self, keep: tuple[int, ...]) -> str:
        return LAYERS_PREFIX + format_layers(keep) + (":" + self.quant.split(":", 1)[1] if self.quant else "")


def format_layers(keep) -> str:
    """(0, 1, 2, 5, 7, 8) -> '0-2,5,7-8'."""
    out, run = [], []
    for i in sorted(keep):
        if run and i != run[-1] + 1:
            out.append(_span(run))
            run = []
        run.append(i)
    if run:
        out.append(_span(run))
    return ",".join(out)


def _span(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"
