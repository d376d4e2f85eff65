"""The progress part: step over time (from samples, saves, faults and restarts) and the loss chart."""

from __future__ import annotations

from datetime import datetime

from controlplane.dashboard.parts.checkpoint_part import checkpoint_rows
from controlplane.dashboard.plots.progress_charts import loss_figure, progress_figure
from controlplane.jobs.goodput import Epoch
from controlplane.jobs.models import Job, RestartCycle, TrainingSample

SAMPLES_SHOWN = 20_000  # the newest samples (about 11 hours at one per 2 s); older ones are not drawn


def progress_part(job: Job, now: datetime) -> dict:
    samples = list(
        TrainingSample.objects.filter(job=job)
        .order_by("-at")
        .values_list(Epoch("at"), "step", "loss", "tokens_per_s", "step_time_s")[:SAMPLES_SHOWN]
    )
    samples.reverse()
    points: list[tuple[float, int]] = [(t, step) for t, step, _, _, _ in samples]
    if job.first_step_at:
        points.append((job.first_step_at.timestamp(), 1))
    points += [(r[0], r[7]) for r in checkpoint_rows(job)]
    for fault_at, step_at_fault, first_at, resumed in RestartCycle.objects.filter(job=job).values_list(
        Epoch("fault_at"), "step_at_fault", Epoch("first_step_at"), "resumed_from_step"
    ):
        if fault_at is not None and step_at_fault is not None:
            points.append((fault_at, step_at_fault))
        if first_at is not None and resumed is not None:
            points.append((first_at, resumed))
    if job.last_progress_at:
        points.append((job.last_progress_at.timestamp(), job.last_step))
    points.sort()
    loss = loss_figure([(t, loss, tps) for t, _, loss, tps, _ in samples])
    return {
        "progress": progress_figure(points, [(t, st) for t, _, _, _, st in samples]),
        "loss": loss,
        "has_samples": loss is not None,
        "has_progress": bool(points),
        "reported": [name for name, i in (("loss", 2), ("tokens/s", 3))
                     if any(r[i] is not None for r in samples)],
        "ended": not job.is_active,
    }
