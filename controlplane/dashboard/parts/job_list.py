"""The job list's rows: progress, restarts per layer, goodput and the last durable save of each job."""

from __future__ import annotations

from datetime import datetime

from django.db.models import Max

from controlplane.dashboard.words import LAYER_NAMES
from controlplane.jobs import readouts
from controlplane.jobs.models import Checkpoint, Job
from trainer.wire import CheckpointState, Layer


def job_rows(jobs: list[Job], now: datetime) -> list[dict]:
    ids = [j.pk for j in jobs]
    restarts = readouts.restarts_by_layer(ids)
    durable = dict(
        Checkpoint.objects.filter(job_id__in=ids, state=CheckpointState.DURABLE)
        .values_list("job_id")
        .annotate(m=Max("finished_at"))
    )
    rows = []
    for j in jobs:
        steps = j.job_spec.steps
        by_layer = restarts.get(j.pk, {})
        rows.append(
            {
                "job": j,
                "steps": steps,
                "progress_pct": readouts.progress_pct(j),
                "restarts": [
                    (LAYER_NAMES[k], by_layer.get(k, 0))
                    for k in (Layer.IN_PROCESS, Layer.IN_JOB, Layer.JOB)
                ],
                "goodput": j.goodput(now)["goodput"],
                "last_durable_at": durable.get(j.pk),
            }
        )
    return rows
