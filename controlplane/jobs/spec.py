"""A job's spec. The type lives on the training side (``trainer.jobspec``), where the ranks decode the
same document the control plane validated and stored; this module names it for the control plane, with
the supervision timeouts derived from it (``Timeouts``: ``Job.timeouts``)."""

from __future__ import annotations

from dataclasses import dataclass

from trainer import wire
from trainer.jobspec import (
    BACKENDS,
    CHECKPOINT_MODES,
    DEMO_SPEC,
    DRILLS_FOR_USER_CODE,
    PRESETS,
    SECRET_ENV,
    Drill,
    JobSpec,
    KubernetesSpec,
    SpecError,
)
from trainer.spec_reference import reference_rows

_STOPPED = wire.Phase.STOPPED.value
_SLOW_PHASES = frozenset(p.value for p in wire.SLOW_PHASES)
_SLOW_OR_STOPPED = _SLOW_PHASES | {_STOPPED}


@dataclass(slots=True, frozen=True)
class Timeouts:
    """The supervision timeouts of one job's spec, in seconds (read once per batch)."""

    step_s: float
    checkpoint_s: float
    stall_s: float

    @classmethod
    def of(cls, spec: JobSpec) -> Timeouts:
        return cls(
            step_s=spec.step_timeout_s, checkpoint_s=spec.checkpoint_timeout_s, stall_s=spec.stall_timeout_s
        )

    def deadline(self, phase: str, at: float) -> float | None:
        """A rank's deadline in unix seconds: ``wire.SLOW_PHASES`` get the checkpoint timeout; a stopped
        rank has none."""
        if phase == _STOPPED:
            return None
        return at + (self.checkpoint_s if phase in _SLOW_PHASES else self.step_s)

    def deadlines(self, phases: list[str], ats: list[float]) -> list[float | None]:
        """``deadline`` over columns (the ingest hot path): in one pass when every beat is in a plain phase."""
        if _SLOW_OR_STOPPED.isdisjoint(phases):
            return [a + self.step_s for a in ats]
        return list(map(self.deadline, phases, ats))


__all__ = [
    "Timeouts",
    "BACKENDS",
    "CHECKPOINT_MODES",
    "DEMO_SPEC",
    "DRILLS_FOR_USER_CODE",
    "PRESETS",
    "SECRET_ENV",
    "Drill",
    "JobSpec",
    "KubernetesSpec",
    "SpecError",
    "reference_rows",
]
