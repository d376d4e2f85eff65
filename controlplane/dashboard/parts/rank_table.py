"""The ranks part: a chip and a table row per rank, or a heatmap and pages for a large job (``fleet.py``),
and the newest quarantined heartbeats."""

from __future__ import annotations

from datetime import datetime

from controlplane.dashboard import fleet
from controlplane.dashboard.parts.lanes import lanes_for
from controlplane.jobs import readouts
from controlplane.jobs.models import Job, QuarantinedHeartbeat


def ranks_part(job: Job, now: datetime, params=None) -> dict:
    """A chip and a table row per rank; a large job's part is a heatmap and pages (``fleet.py``)."""
    if fleet.is_large(job):
        out = fleet.ranks_part(job, now, params or {})
        out["quarantined"] = _quarantined(job)
        return out
    lanes = lanes_for(job, now)
    rows = []
    for f in readouts.rank_figures(job, [ln["row"] or (ln["rank"], None) for ln in lanes], now):
        rows.append(
            {
                "rank": f.rank,
                "node": f.node,
                "health": "waiting" if f.health == readouts.UNKNOWN else f.health,
                "age": now.timestamp() - f.hb_at if f.hb_at else None,
                "hb_at": f.hb_at,
                "hb_ms": int(f.hb_at * 1000) if f.hb_at else None,
                "phase": f.phase,
                "step": f.step,
                "loss": f.loss,
                "step_time_s": f.step_time_s,
                "busy_s": f.busy_s,
                "slowdown_pct": f.slowdown_pct,
                "pid": f.pid,
                "why": _why_no_heartbeat(job) if f.health == readouts.UNKNOWN else "",
            }
        )
    return {"rows": rows, "now": now.timestamp(), "quarantined": _quarantined(job)}


def _quarantined(job: Job) -> list:
    return list(QuarantinedHeartbeat.objects.filter(job=job).order_by("-at")[:QUARANTINE_SHOWN])


QUARANTINE_SHOWN = 10


def _why_no_heartbeat(job: Job) -> str:
    why = "the job has not started training" if job.is_active else "it never reported"
    return f"no heartbeat yet: {why}"
