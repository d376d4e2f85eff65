"""What every benchmark computes and prints the same way: percentiles, spreads and its verdict.

- ``percentile(xs, q)``: nearest rank (the ceil(q * n)-th smallest value), so p95 of 16 is the largest
  and p50 of an even count the lower middle; never interpolated, so the figure is one that was measured.
- ``figure(xs)``: ``median`` with ``n`` and the spread (min..max), as every figure is printed.
- ``Target`` and ``verdict``: each benchmark's targets (its README row), printed beside its figures;
  ``verdict`` returns the exit status (1 when any is missed; a figure that is nan or absent is missed),
  so ``make bench-*`` fails after printing.

    figures = {"p99_ms": 12.0}
    sys.exit(verdict(figures, [Target("p99_ms", "<=", 50)]))
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

_OPS = {"<=": operator.le, ">=": operator.ge, "==": operator.eq}


def percentile(xs: Iterable[float], q: float) -> float:
    """The nearest-rank q-quantile (0 < q <= 1) of xs; nan for none."""
    if not 0 < q <= 1:
        raise ValueError(f"percentile: q must be in (0, 1], got {q!r}")
    s = sorted(xs)
    if not s:
        return float("nan")
    return s[max(0, math.ceil(q * len(s)) - 1)]


def median(xs: Iterable[float]) -> float:
    """The nearest-rank median (the lower middle of an even count): a value that was measured."""
    return percentile(xs, 0.5)


def figure(xs: Iterable[float], nd: int = 3, unit: str = "") -> str:
    """``median M (min..max, n=N)``."""
    s = sorted(xs)
    if not s:
        return "none (n=0)"
    return f"median {median(s):.{nd}f}{unit} ({s[0]:.{nd}f}..{s[-1]:.{nd}f}, n={len(s)})"


@dataclass(frozen=True, slots=True)
class Target:
    """One target of a benchmark's README row: ``figures[name] <op> bound``."""

    name: str
    op: str
    bound: float

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"Target {self.name}: op must be one of {sorted(_OPS)}, got {self.op!r}")

    def met(self, value: float | None) -> bool:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return False
        return bool(_OPS[self.op](value, self.bound))


def verdict(figures: Mapping[str, float | None], targets: Iterable[Target]) -> int:
    """Print each target beside its figure, then ``targets: met`` or ``targets: MISSED <names>``;
    return the exit status (0 when all are met, 1 otherwise)."""
    missed = []
    for t in targets:
        value = figures.get(t.name)
        ok = t.met(value)
        missed += [] if ok else [t.name]
        shown = "absent" if value is None else f"{value:g}"
        print(f"target {t.name} {t.op} {t.bound:g}: {shown} {'met' if ok else 'MISSED'}")
    print("targets: met" if not missed else f"targets: MISSED {' '.join(missed)}", flush=True)
    return 1 if missed else 0
