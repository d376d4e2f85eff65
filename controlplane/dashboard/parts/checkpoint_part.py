"""The checkpoints part: each save's figures, the counts by state, the sync-or-async advice and the chart."""

from __future__ import annotations

from controlplane.dashboard.plots.checkpoint_chart import checkpoint_figure
from controlplane.jobs import readouts
from controlplane.jobs.goodput import Epoch
from controlplane.jobs.models import Checkpoint, Job


def checkpoint_rows(job: Job) -> list[tuple]:
    """Every save of the job as plain tuples (epoch floats), loaded once per request: the checkpoint
    chart and the progress chart both read them."""
    rows = getattr(job, "_dashboard_checkpoints", None)
    if rows is None:
        rows = list(
            Checkpoint.objects.filter(job=job)
            .order_by("started_at")
            .values_list(
                Epoch("started_at"),
                Epoch("finished_at"),
                "blocking_s",
                "write_s",
                "bytes",
                "mode",
                "state",
                "step",
                "interference_s",
            )
        )
        job._dashboard_checkpoints = rows
    return rows


def checkpoint_part(job: Job) -> dict:
    rows = []
    for started_at, finished_at, blocking_s, write_s, nbytes, mode, state, step, interf in checkpoint_rows(job):
        fig = readouts.checkpoint_figures(
            started_at=started_at, finished_at=finished_at, state=state, write_s=write_s, nbytes=nbytes
        )
        rows.append(
            {
                "started_at": started_at,
                "step": step,
                "mode": mode,
                "state": state,
                "blocking_s": blocking_s,
                "interference_s": interf,
                "elapsed_s": fig.elapsed_s,
                "durable_s": fig.durable_s,
                "mb_per_s": fig.mb_per_s,
            }
        )
    counts = readouts.checkpoint_counts(r["state"] for r in rows)
    advice = readouts.checkpoint_mode_advice(
        (r[5], r[6], r[2], r[3], r[8]) for r in checkpoint_rows(job)
    )
    return {"chart": checkpoint_figure(rows), "counts": counts, "recent": list(reversed(rows[-8:])),
            "total": len(rows), "advice": advice, "mode": (job.spec or {}).get("checkpoint_mode") or "async",
            "min_saves": readouts.MIN_ADVICE_SAVES}
