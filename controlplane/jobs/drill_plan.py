"""A resilience check: a run of a job's own spec (same entrypoint, args, environment, integration level)
with a drill plan, an ordinary job whose faults come on a schedule the plan lays out.

A plan names fault classes, where each lands relative to the checkpoints, on which ranks, how often:
every (class, placement, rank) combination ``repeats`` times. Drills are spaced two checkpoint
intervals apart, so each one's rollback and recovery are over before the next fires. Placements, as
steps past a save (interval I):

- ``save_in_flight``: 1 step after the save (an async save is still being written);
- ``after_save``: a fifth of the interval after it (the save is done; little work is lost);
- ``mid_interval``: half an interval after it;
- ``before_save``: one step before the next save (the most work lost).

``killed_during_save`` is a sigkill placed while the save is in flight. The run is tagged with its plan
by an audit entry on the new job (action ``resilience.plan``) and one on the job it checks
(``job.resilience_check``); ``plan_of(job)`` reads it back.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

import msgspec
from django.db import transaction

from controlplane.jobs import readouts, services
from controlplane.jobs.models import AuditEntry, Job, RestartCycle
from controlplane.jobs.resilience_report import step_time
from controlplane.jobs.spec import Drill, JobSpec, SpecError

LEVEL0_FAULTS = ("exception", "hang", "sigkill")
LEVEL2_FAULTS = (*LEVEL0_FAULTS, "nan_loss", "hang_collective", "killed_during_save")
PLACEMENTS = ("save_in_flight", "after_save", "mid_interval", "before_save")
RANKS = ("first", "last")
GAP_INTERVALS = 2
MAX_DRILLS = 64
# A fault's cost before the job has measured it (seconds): detection plus a restart. A hang waits for the
# step timeout, which the spec sets.
DEFAULT_RECOVERY_S = {"exception": 5.0, "nan_loss": 5.0, "sigkill": 15.0, "killed_during_save": 20.0}
DEFAULT_STEP_S = 0.25  # the tiny preset on a laptop CPU
DEFAULT_STARTUP_S = 20.0
FAULT_CLASS = {"exception": "exception", "hang": "hang", "hang_collective": "hang",
               "sigkill": "process_killed", "killed_during_save": "process_killed", "nan_loss": "nan_loss"}


class PlanError(ValueError):
    def __init__(self, errors: dict[str, str]):
        super().__init__("; ".join(f"{k}: {v}" for k, v in errors.items()))
        self.errors = errors


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    faults: tuple[str, ...]
    placements: tuple[str, ...] = ("mid_interval",)
    ranks: tuple[str, ...] = RANKS
    repeats: int = 1

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


def supported_faults(spec: JobSpec) -> tuple[str, ...]:
    """Level 2 (the built-in model, or an SDK entrypoint with in-process restarts) takes every drill; an own
    script without the in-process layer takes exception, hang and sigkill (the spec's own rule)."""
    return LEVEL2_FAULTS if (not spec.entrypoint or spec.in_process) else LEVEL0_FAULTS


def default_plan(spec: JobSpec) -> Plan:
    """Every supported class twice: on the first and on the last rank, mid-interval."""
    return Plan(faults=supported_faults(spec))


def check(spec: JobSpec, plan: Plan) -> None:
    errors = {}
    ok = supported_faults(spec)
    bad = [f for f in plan.faults if f not in ok]
    if not plan.faults:
        errors["faults"] = f"choose at least one of {', '.join(ok)}"
    elif bad:
        errors["faults"] = (f"{', '.join(bad)}: not at this job's integration level; it takes {', '.join(ok)}"
                            + ("" if ok == LEVEL2_FAULTS else " (the rest need the SDK's entrypoint: "
                               "docs/guides/resilience-report.md)"))
    if not plan.placements or any(p not in PLACEMENTS for p in plan.placements):
        errors["placements"] = f"choose from {', '.join(PLACEMENTS)}"
    if not plan.ranks or any(r not in RANKS for r in plan.ranks):
        errors["ranks"] = "choose first, last or both"
    if not 1 <= plan.repeats <= 10:
        errors["repeats"] = "must be within 1..10"
    if not errors and len(_slots(plan)) > MAX_DRILLS:
        errors["repeats"] = f"at most {MAX_DRILLS} drills in one check: fewer classes, placements or repeats"
    if errors:
        raise PlanError(errors)


def _slots(plan: Plan) -> list[tuple[str, str, str]]:
    out = []
    for _ in range(plan.repeats):
        for f in plan.faults:
            for p in ("save_in_flight",) if f == "killed_during_save" else plan.placements:
                for r in plan.ranks:
                    out.append((f, p, r))
    return out


def _offset(placement: str, interval: int) -> int:
    return {"save_in_flight": 1, "after_save": max(1, interval // 5), "mid_interval": max(1, interval // 2),
            "before_save": max(1, interval - 1)}[placement]


def schedule(spec: JobSpec, plan: Plan) -> tuple[tuple[Drill, ...], int]:
    """The drills (in step order) and the steps the run needs: a save, then one drill every
    ``GAP_INTERVALS`` intervals, then one more interval."""
    check(spec, plan)
    interval = spec.checkpoint_interval
    last = spec.world_size - 1
    drills = []
    for j, (fault, placement, rank) in enumerate(_slots(plan)):
        step = (1 + GAP_INTERVALS * j) * interval + _offset(placement, interval)
        drills.append(Drill(step=step, fault="sigkill" if fault == "killed_during_save" else fault,
                            rank=0 if rank == "first" else last))
    steps = drills[-1].step + 2 * interval
    # Two drills at one step, fault and rank would be one (the trainer fires each key once): none are,
    # as every drill has its own interval.
    return tuple(drills), steps


@dataclass(frozen=True, kw_only=True, slots=True)
class Budget:
    total_s: float
    steps: int
    step_s: float
    startup_s: float
    recovery_s: float
    measured: bool  # from the job's own step and recovery times (else defaults)


def budget(job: Job, spec: JobSpec, plan: Plan) -> Budget:
    """How long the check should take: start-up, the steps (re-done ones included), each fault's recovery
    (the job's own mean for its class when it has one)."""
    drills, steps = schedule(spec, plan)
    measured_step = step_time(job)
    step_s = measured_step or DEFAULT_STEP_S
    g = job.goodput()
    startup = g.get("startup_s") or DEFAULT_STARTUP_S
    own = _own_recoveries(job)
    rec = 0.0
    for fault, placement, _ in _slots(plan):
        cls = FAULT_CLASS[fault]
        if cls in own:
            r = own[cls]
        elif fault in ("hang", "hang_collective"):
            r = hang_after_s(job, spec) + 10.0
        else:
            r = DEFAULT_RECOVERY_S[fault]
        rec += r + _offset(placement, spec.checkpoint_interval) * step_s  # and the steps it re-does
    return Budget(total_s=startup + steps * step_s + rec, steps=steps, step_s=step_s, startup_s=startup,
                  recovery_s=rec, measured=measured_step is not None)


def hang_after_s(job: Job, spec: JobSpec) -> float:
    """When a hang is ended: at the step timeout where the loop beats (the built-in model, Level 1 and 2);
    a script without the SDK (Level 0, or a script not seen running yet) at the stall timeout, since only
    its printed step shows progress (``trainer.usercode``)."""
    if not spec.entrypoint or spec.in_process:
        return spec.step_timeout_s
    seen = readouts.integration(job)
    return spec.step_timeout_s if seen is not None and (seen.level or 0) >= 1 else spec.stall_timeout_s


def _own_recoveries(job: Job) -> dict[str, float]:
    by_class: dict[str, list[float]] = {}
    for c in RestartCycle.objects.filter(job=job, first_step_at__isnull=False).prefetch_related("faults"):
        fs = sorted(c.faults.all(), key=lambda f: f.pk)
        if fs and c.recovery_s is not None:
            by_class.setdefault(fs[0].fault_class, []).append(c.recovery_s)
    return {k: statistics.fmean(v) for k, v in by_class.items()}


def plan_spec(spec: JobSpec, plan: Plan) -> JobSpec:
    """The job's own spec with the plan's drills (and enough steps to reach them)."""
    drills, steps = schedule(spec, plan)
    # An own script runs as long as its own arguments say; the spec's steps are its progress bar.
    steps = max(steps, spec.steps) if spec.entrypoint else steps
    try:
        data = spec.to_dict()  # validated again as a whole: the drills against the job's ranks and steps
        data.update(drills=[msgspec.to_builtins(d) for d in drills], steps=steps)
        return JobSpec.from_dict(data)
    except SpecError as e:
        raise PlanError(e.errors) from None


def start_resilience_check(*, job: Job, plan: Plan, requested_by, remote_addr: str | None = None) -> Job:
    """Create and launch the check's run (audited on both jobs)."""
    spec = plan_spec(job.job_spec, plan)
    est = budget(job, job.job_spec, plan)
    detail = {"plan": plan.to_dict(), "source_job": job.pk, "drills": [d.as_flag() for d in spec.drills],
              "budget_s": round(est.total_s, 1)}
    with transaction.atomic():  # the launch is enqueued on commit, with both audit lines written
        run = services.create_job(name=f"{job.name[:70]} · resilience check", spec=spec,
                                  created_by=requested_by, remote_addr=remote_addr)
        services.record_audit(actor=requested_by, action="resilience.plan", job=run, detail=detail,
                              remote_addr=remote_addr)
        services.record_audit(actor=requested_by, action="job.resilience_check", job=job,
                              detail={**detail, "run": run.pk}, remote_addr=remote_addr)
    return run


def plan_of(job: Job) -> dict | None:
    """The plan a resilience check's run was started with (None for any other job)."""
    entry = AuditEntry.objects.filter(job=job, action="resilience.plan").order_by("id").first()
    return entry.detail if entry is not None else None
