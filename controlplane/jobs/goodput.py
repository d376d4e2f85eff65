"""Goodput: where a job's wall time went. One definition, shown on the job page.

Over wall time W (job start to now, or to its end) the parts are:

- **startup**: job start (``started_at``, else ``created_at``) to the first completed step;
- **recovery**: the union of restart cycles, each from its fault to the first step after it
  (``first_step_at - fault_at``; an open cycle runs to now);
- **checkpoint blocking**: time the training loop waited on saves (``Checkpoint.blocking_s``; a sync
  save without that figure counts its whole save), except saves that began inside a recovery;
- **productive**: step time of the steps that count toward the final model (``job.last_step`` steps);
- **lost work**: step time of steps recomputed after a rollback (``RestartCycle.lost_steps``; an open
  cycle's loss is the steps since the last durable checkpoint);
- **idle**: the rest (waiting with no step running, e.g. a stalled rank before anything noticed).

Heartbeats are not stored as history, so step time is estimated: the median of the ranks' latest
``step_time_s``, capped by "training time / steps executed" (the cap is what it must be if the loop
never idled). Without any measured step time, the loop is assumed never idle. Accepted trade-off:
goodput is an estimate at the resolution of those facts, and it always adds up to W exactly.

``compute_goodput`` returns shares of W under the part names (they add up to 1), the same parts in
seconds under ``<part>_s``, ``wall_s`` and ``goodput`` (= the productive share).
"""

from __future__ import annotations

import bisect
import statistics
from datetime import datetime

from django.db.models import FloatField, Func, Max

from controlplane.jobs.models import RestartCycle
from trainer.wire import CheckpointMode, CheckpointState

PARTS = ("productive", "checkpoint_blocking", "recovery", "lost_work", "startup", "idle")


def _union_length(intervals: list[tuple[float, float]]) -> tuple[float, list[tuple[float, float]]]:
    merged: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return sum(b - a for a, b in merged), merged


def compute_goodput(job, now: datetime) -> dict[str, float]:
    start_dt = job.started_at or job.created_at
    end_dt = job.finished_at or now
    start = start_dt.timestamp()
    end = max(start, end_dt.timestamp())
    wall = end - start
    seconds = dict.fromkeys(PARTS, 0.0)
    if wall <= 0:
        return _result(seconds, wall)

    first_step = job.first_step_at.timestamp() if job.first_step_at else None
    train_from = min(max(first_step, start), end) if first_step is not None else end
    seconds["startup"] = train_from - start

    cycles = job.cycles.values_list(
        Epoch("fault_at"),
        Epoch("detected_at"),
        Epoch("aborted_at"),
        Epoch("restarted_at"),
        Epoch("first_step_at"),
        "step_at_fault",
        "resumed_from_step",
        "step_at_fault_estimate",
    )
    intervals = []
    lost_steps = 0
    for fault_at, detected_at, aborted_at, restarted_at, first_at, *steps in cycles:
        began = next((t for t in (fault_at, detected_at, aborted_at, restarted_at) if t is not None), None)
        if began is None:
            continue
        intervals.append((max(began, train_from), min(first_at if first_at is not None else end, end)))
        # One definition of steps lost (RestartCycle.steps_lost), on the values alone.
        c = RestartCycle(step_at_fault=steps[0], resumed_from_step=steps[1], step_at_fault_estimate=steps[2])
        durable = None
        at_fault = c.step_at_fault if c.step_at_fault is not None else c.step_at_fault_estimate
        if c.resumed_from_step is None and at_fault is not None:
            # still recovering: it resumes from the newest durable checkpoint at or before the fault
            durable = job.checkpoints.filter(state=CheckpointState.DURABLE, step__lte=at_fault).aggregate(
                m=Max("step"))["m"] or 0
        lost_steps += c.steps_lost(durable_step=durable) or 0
    seconds["recovery"], merged = _union_length(intervals)
    seconds["checkpoint_blocking"] = _blocking(job, train_from, end, merged)

    # Inconsistent facts (overlaps we do not model) must not push the parts past W.
    overhead = seconds["startup"] + seconds["recovery"] + seconds["checkpoint_blocking"]
    if overhead > wall:
        scale = wall / overhead
        for k in ("startup", "recovery", "checkpoint_blocking"):
            seconds[k] *= scale
        overhead = wall
    training = wall - overhead

    counted = max(0, job.last_step or 0)
    executed = counted + lost_steps
    if executed > 0 and training > 0:
        fit = training / executed
        measured = [s for s in job.ranks.values_list("step_time_s", flat=True) if s and s > 0]
        step_s = min(statistics.median(measured), fit) if measured else fit
        seconds["productive"] = counted * step_s
        seconds["lost_work"] = lost_steps * step_s
    seconds["idle"] = max(0.0, training - seconds["productive"] - seconds["lost_work"])
    return _result(seconds, wall)


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


def _blocking(job, train_from: float, end: float, recoveries: list[tuple[float, float]]) -> float:
    """Seconds the loop waited on saves begun in [train_from, end) outside recoveries."""
    starts = [a for a, _ in recoveries]
    total = 0.0
    for t, finished, blocking_s, mode in job.checkpoints.values_list(
        Epoch("started_at"), Epoch("finished_at"), "blocking_s", "mode"
    ):
        if t < train_from or t >= end:
            continue
        i = bisect.bisect_right(starts, t) - 1
        if i >= 0 and t < recoveries[i][1]:
            continue  # a save begun inside a recovery is part of that recovery
        if blocking_s is None and mode == CheckpointMode.SYNC and finished is not None:
            blocking_s = (
                finished - t
            )  # a sync save that did not report its blocked time blocked for all of it
        total += min(max(0.0, blocking_s or 0.0), end - t)
    return total


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
