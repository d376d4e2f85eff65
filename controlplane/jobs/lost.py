"""Steps lost: the one definition (restart cycles, faults, goodput's lost work and the API read it).
Pure functions over the trainer's facts, so that both the models and goodput can use them."""

from __future__ import annotations


def steps_lost(step_at_fault: int | None, resumed_from_step: int | None) -> int | None:
    """Steps a recovery threw away: the step at the fault minus the step restored from."""
    if step_at_fault is not None and resumed_from_step is not None:
        return max(0, step_at_fault - resumed_from_step)
    return None


def cycle_steps_lost(*, step_at_fault: int | None, step_at_fault_estimate: int | None,
                     resumed_from_step: int | None, durable_step: int | None = None) -> int | None:
    """A restart cycle's steps lost from the trainer's facts; an older trainer's fault without a step has
    the control plane's estimate. While the cycle has not restored yet, ``durable_step`` (the newest
    durable checkpoint at or before the fault) stands in for the step restored from."""
    at_fault = step_at_fault if step_at_fault is not None else step_at_fault_estimate
    resumed = resumed_from_step if resumed_from_step is not None else durable_step
    return steps_lost(at_fault, resumed)
