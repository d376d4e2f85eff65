"""A job's time bounds and its rank lanes (each rank's row moved forward to the freshest heartbeat), shared
by the timeline and the rank table."""

from __future__ import annotations

from datetime import datetime

from controlplane.jobs import rank_health, readouts
from controlplane.jobs.models import Job, Rank


def job_bounds(job: Job, now: datetime) -> tuple[float, float]:
    start = (job.started_at or job.created_at).timestamp()
    end = (job.finished_at or now).timestamp()
    return start, max(start, end)


def lanes_for(job: Job, now: datetime) -> list[dict]:
    """One lane per rank, ordered by (node, rank); loaded once per request (timeline and health strip)."""
    cached = getattr(job, "_dashboard_lanes", None)
    if cached is not None:
        return cached
    ranks = {r.rank: r for r in Rank.objects.filter(job=job)}
    job._dashboard_lanes = rank_lanes(job, now, ranks, sorted(set(range(job.world_size)) | set(ranks)))
    return job._dashboard_lanes


def rank_lanes(job: Job, now: datetime, ranks: dict[int, Rank], ids: list[int]) -> list[dict]:
    # Each row moved forward to the heartbeat store's newest beat, judged by the watchdog's own rule.
    fresh = readouts.freshest(job, ids) if job.is_active and ids else {}
    timeouts = job.timeouts
    lanes = []
    for i in ids:
        r = ranks.get(i)
        if i in fresh:
            r = rank_health.current(r or Rank(job=job, rank=i), fresh[i], timeouts, now)
        lanes.append({"rank": i, "node": r.node if r else "", "row": r})
    lanes.sort(key=lambda ln: (ln["node"], ln["rank"]))
    return lanes
