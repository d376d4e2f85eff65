"""Goodput: where a job's wall time went. One definition, shown on the job page and the jobs list.

Over wall time W (job start to now, or to its end) every instant belongs to exactly one part, taken
in this order (an instant that two facts claim goes to the earlier part):

- **startup**: job start (the earlier of ``created_at`` and ``started_at``: a launch is part of the
  job's wall time, and W must not shrink when the launch ends) to the first completed step;
- **recovery**: each restart cycle, from its fault to the first step after it (an open cycle runs to
  the end of W). An operator's restart begins when the trainer acted on the command (its first mark
  after fetching it), not when it was issued: the loop kept training, and reporting steps, until then;
- **checkpoint blocking**: time the training loop waited on saves (``Checkpoint.blocking_s``; a sync
  save without that figure blocked for all of it);
- **checkpoint interference**: the steps an async save slowed down while it ran in the background
  (``Checkpoint.interference_s``, the trainer's measure against the step times just before it),
  booked right after the save's blocked time;
- **lost work**: recomputing the steps a rollback threw away: from a cycle's first step until training
  passes the step of the fault again (the first training sample at or past it, or the job's newest
  progress, whichever is earlier), or to the end of W while it has not;
- **idle**: time since the newest step progress the control plane knows of (``last_progress_at``:
  a stall nobody has explained yet, the seconds not yet reported, the exit after the last step), or
  since the start of a save still in flight (its blocked time is known when it ends);
- **productive**: the rest: the loop making progress that counts.

Every part is a union of intervals from stored facts with their own timestamps, so the parts add up
to W exactly, idle is the same computation while the job runs and after it ended, and productive
time never decreases: time counts as productive only once a step after it has been reported, and
the facts that take time away from it (a fault, a save, a rollback) begin no earlier than the newest
progress that was reported before them. A property test over generated event sequences holds the
definition to that.

``compute_goodput`` returns shares of W under the part names (they add up to 1), the same parts in
seconds under ``<part>_s``, ``wall_s`` and ``goodput`` (= the productive share).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db.models import FloatField, Func, Max, OuterRef, Subquery
from django.db.models.functions import Coalesce

from controlplane.jobs.lost import cycle_steps_lost
from trainer.wire import CheckpointMode, CheckpointState

PARTS = ("productive", "checkpoint_blocking", "checkpoint_interference", "recovery", "lost_work", "startup",
         "idle")


Interval = tuple[float, float]


@dataclass(frozen=True, slots=True)
class CycleFacts:
    began: float  # the cycle's first mark (its fault, else detection, abort, restart)
    first_step_at: float | None  # None: still recovering
    lost_steps: int | None
    reached_again_at: float | None  # when training passed the fault's step again (None: not yet / unknown)


@dataclass(frozen=True, slots=True)
class GoodputFacts:
    """What goodput is computed from, as unix seconds: the loader below reads it from the database;
    the property test generates it."""

    start: float
    end: float  # the job's end, or now
    first_step: float | None
    last_progress_at: float | None
    cycles: tuple[CycleFacts, ...] = ()
    # (started at, seconds the loop was blocked, seconds of slower steps while it ran in the background)
    saves: tuple[tuple[float, float, float], ...] = ()
    # The earliest save still in flight (its blocked time is reported when it ends): time after it is
    # not yet known to be productive.
    save_in_flight_since: float | None = None


def _merge(intervals) -> list[Interval]:
    merged: list[Interval] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _minus(intervals: list[Interval], taken: list[Interval]) -> list[Interval]:
    """``intervals`` (merged) without what ``taken`` (merged) covers. Both are sorted and disjoint, so one
    sweep does it (thousands of saves against thousands of taken intervals on a long job's page)."""
    out: list[Interval] = []
    j = 0
    for a, b in intervals:
        while j < len(taken) and taken[j][1] <= a:
            j += 1  # taken intervals wholly before this one (and so before every later one)
        cur = a
        for x, y in taken[j:]:
            if x >= b:
                break
            if x > cur:
                out.append((cur, x))
            cur = max(cur, y)
            if cur >= b:
                break
        if cur < b:
            out.append((cur, b))
    return out


def _length(intervals: list[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def goodput_from_facts(f: GoodputFacts) -> dict[str, float]:
    start, end = f.start, max(f.start, f.end)
    wall = end - start
    seconds = dict.fromkeys(PARTS, 0.0)
    if wall <= 0:
        return _result(seconds, wall)
    train_from = min(max(f.first_step, start), end) if f.first_step is not None else end
    seconds["startup"] = train_from - start

    def clip(a: float, b: float) -> Interval:
        return (max(a, train_from), min(b, end))

    taken: list[Interval] = []
    parts = (
        ("recovery", [clip(c.began, c.first_step_at if c.first_step_at is not None else end)
                      for c in f.cycles]),
        ("checkpoint_blocking", [clip(t, t + max(0.0, b)) for t, b, _ in f.saves]),
        ("checkpoint_interference", [clip(t + max(0.0, b), t + max(0.0, b) + max(0.0, i))
                                     for t, b, i in f.saves]),
        ("lost_work", [clip(c.first_step_at, c.reached_again_at if c.reached_again_at is not None else end)
                       for c in f.cycles if c.first_step_at is not None and (c.lost_steps or 0) > 0]),
        ("idle", [clip(min(f.last_progress_at if f.last_progress_at is not None else train_from,
                           f.save_in_flight_since if f.save_in_flight_since is not None else end), end)]),
    )
    for name, intervals in parts:
        mine = _minus(_merge(intervals), taken)
        seconds[name] = _length(mine)
        taken = _merge(taken + mine)
    seconds["productive"] = max(0.0, wall - sum(seconds[k] for k in PARTS if k != "productive"))
    return _result(seconds, wall)


def compute_goodput(job, now: datetime) -> dict[str, float]:
    return goodput_from_facts(goodput_facts(job, now))


def goodput_facts(job, now: datetime) -> GoodputFacts:
    """The job's goodput facts from its rows: cycles, saves, progress and (for each rollback) the first
    training sample past the fault's step."""
    start = min(job.created_at, job.started_at or job.created_at).timestamp()
    end = (job.finished_at or now).timestamp()
    progress = job.last_progress_at.timestamp() if job.last_progress_at else None
    cycles = []
    # Per cycle, in the same query: the first training sample after its first step at or past the fault's
    # step (when the lost work was done again); one index seek per cycle, not one query per cycle.
    samples = job.samples.model.objects  # TrainingSample, without an import circle (models import this)
    again = (samples.filter(job=OuterRef("job"), at__gt=OuterRef("first_step_at"),
                            step__gte=Coalesce(OuterRef("step_at_fault"), OuterRef("step_at_fault_estimate")))
             .order_by("at").values_list(Epoch("at"))[:1])
    rows = job.cycles.values_list(Epoch("fault_at"), Epoch("delivered_at"), Epoch("detected_at"),
                                  Epoch("aborted_at"), Epoch("restarted_at"), Epoch("first_step_at"),
                                  Subquery(again, output_field=FloatField()),
                                  "step_at_fault", "resumed_from_step", "step_at_fault_estimate")
    for fault_at, delivered_at, detected_at, aborted_at, restarted_at, first_at, sample, *steps in rows:
        began = cycle_began(fault_at, delivered_at, detected_at, aborted_at, restarted_at)
        if began is None:
            continue
        step_at_fault, resumed_from, estimate = steps
        at_fault = step_at_fault if step_at_fault is not None else estimate
        durable = None
        if resumed_from is None and at_fault is not None:
            # still recovering: it resumes from the newest durable checkpoint at or before the fault
            durable = job.checkpoints.filter(state=CheckpointState.DURABLE, step__lte=at_fault).aggregate(
                m=Max("step"))["m"] or 0
        lost = cycle_steps_lost(step_at_fault=step_at_fault, step_at_fault_estimate=estimate,
                                resumed_from_step=resumed_from, durable_step=durable)
        reached = None
        if first_at is not None and lost:
            bounds = [progress] if progress is not None and progress > first_at else []
            if sample is not None:
                bounds.append(sample)
            reached = min(bounds) if bounds else None
        cycles.append(CycleFacts(began=began, first_step_at=first_at, lost_steps=lost,
                                 reached_again_at=reached))
    saves = []
    in_flight = []
    newest_cycle = max((c.began for c in cycles), default=None)
    for t, finished, blocking_s, interference_s, mode, state in job.checkpoints.values_list(
        Epoch("started_at"), Epoch("finished_at"), "blocking_s", "interference_s", "mode", "state"
    ):
        if state == CheckpointState.IN_FLIGHT and (newest_cycle is None or t >= newest_cycle):
            in_flight.append(t)  # one begun before the newest fault was cut short by it
        if state == CheckpointState.ABANDONED:
            continue  # cut short by a fault: what it blocked before the fault counts as training
        if blocking_s is None and mode == CheckpointMode.SYNC and finished is not None:
            blocking_s = finished - t  # a sync save that did not report its blocked time: all of it
        if blocking_s or interference_s:
            saves.append((t, blocking_s or 0.0, interference_s or 0.0))
    return GoodputFacts(
        start=start,
        end=end,
        first_step=job.first_step_at.timestamp() if job.first_step_at else None,
        last_progress_at=progress,
        cycles=tuple(cycles),
        saves=tuple(saves),
        save_in_flight_since=min(in_flight, default=None),
    )


def cycle_began(fault_at: float | None, delivered_at: float | None, *marks: float | None) -> float | None:
    """When a cycle began taking the job's time: its first mark; for an operator's restart (a command
    the trainer fetched at ``delivered_at``), the trainer's first mark after the fetch (the loop trained
    on until then), else the fetch."""
    if delivered_at is not None:
        return min((t for t in marks if t is not None and t >= delivered_at), default=delivered_at)
    return next((t for t in (fault_at, *marks) if t is not None), None)


class Epoch(Func):
    """A datetime column as unix seconds (float), computed by the database: turning thousands of datetimes
    into Python objects dominates a long job's page on SQLite, and the arithmetic only needs seconds."""

    function = ""
    output_field = FloatField()

    def as_sqlite(self, compiler, connection, **extra):
        return self.as_sql(
            compiler, connection, template="((julianday(%(expressions)s) - 2440587.5) * 86400.0)", **extra
        )

    def as_postgresql(self, compiler, connection, **extra):
        return self.as_sql(
            compiler, connection, template="EXTRACT(EPOCH FROM %(expressions)s)::float8", **extra
        )

    def as_mysql(self, compiler, connection, **extra):
        return self.as_sql(compiler, connection, template="UNIX_TIMESTAMP(%(expressions)s)", **extra)


def _result(seconds: dict[str, float], wall: float) -> dict[str, float]:
    out: dict[str, float] = {"wall_s": wall}
    if wall <= 0:
        shares = dict.fromkeys(PARTS, 0.0)
        shares["startup"] = 1.0
    else:
        shares = {k: seconds[k] / wall for k in PARTS}
    for k in PARTS:
        out[k] = shares[k]
        out[f"{k}_s"] = seconds[k]
    out["goodput"] = shares["productive"]
    return out
