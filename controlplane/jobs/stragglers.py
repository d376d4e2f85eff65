"""Straggler marks: the watchdog records when a rank became a straggler and when it recovered.

The live judgement is ``health.slowdowns`` (the rank table, the API and ``/metrics`` read it at every
request, with the heartbeat store's newest beats). This pass turns it into history for the timeline: a
rank that starts straggling is claimed (``Rank.straggler_at``, a conditional UPDATE, so concurrent passes
mark it once) and a ``straggler`` event with ``state`` "marked" and its slowdown is stored; when it recovers
the claim is cleared and a "cleared" event is stored. Events are kept with ``source`` "watchdog".

Accepted trade-off: the pass reads the ``Rank`` rows (two queries of numbers per active job: each
training rank's busy time, and the ranks marked now), which lag the Redis heartbeat store by up to a
flush; the rank table shows a straggler up to that much earlier than its mark. At 100,000 ranks the pass
takes ~60 ms, 12 ms of it this process's CPU (loading the rows as objects took 2.3 s of CPU on every
watchdog pass: a Celery process kept busy through a restart storm).
"""

from __future__ import annotations

import logging
from datetime import datetime

from django.db import connection, transaction

from controlplane.jobs import policy, readouts
from controlplane.jobs.models import ACTIVE_STATUSES, Event, Job, Rank

log = logging.getLogger(__name__)

STRAGGLER_EVENT = "straggler"  # an Event kind the control plane writes (source "watchdog")


def mark_stragglers(now: datetime) -> int:
    """Mark and clear stragglers of every active job; returns the number of transitions recorded."""
    n = 0
    for job in Job.objects.filter(status__in=ACTIVE_STATUSES).only("pk", "spec", "status"):
        try:
            n += _mark_job(job, now)
        except Exception:
            log.exception("watchdog: straggler marks of job %s failed", job.pk)
    return n


def _mark_job(job: Job, now: datetime) -> int:
    ranks = Rank.objects.filter(job=job)
    slow = readouts.slowdowns_of(job, ranks, now)
    marked = set(ranks.filter(straggler_at__isnull=False).values_list("rank", flat=True))
    new, gone = sorted(set(slow) - marked), sorted(marked - set(slow))
    if not new and not gone:
        return 0
    with transaction.atomic():
        claimed = _update(job.pk, new, now, set_now=True)
        cleared = _update(job.pk, gone, now, set_now=False)
        stamp = f"{now.timestamp():.6f}"
        Event.objects.bulk_create(
            [Event(job=job, event_id=f"straggler-{r}-m-{stamp}", kind=STRAGGLER_EVENT, rank=r, at=now,
                   source="watchdog", data={"state": "marked", "slowdown_pct": slow[r]}) for r in claimed]
            + [Event(job=job, event_id=f"straggler-{r}-c-{stamp}", kind=STRAGGLER_EVENT, rank=r, at=now,
                     source="watchdog", data={"state": "cleared"}) for r in cleared],
            ignore_conflicts=True)
        for r in claimed:  # a written failure-policy rule for stragglers (notify, restart in-job) acts
            policy.apply_to_straggler(job, r, slow[r], now)
    for r in claimed:
        log.info("job %s: rank %s is a straggler (%.1f %% slower than the others' median)", job.pk, r, slow[r])
    return len(claimed) + len(cleared)


def _update(job_id: int, ranks: list[int], now: datetime, *, set_now: bool) -> list[int]:
    """Claim (``set_now``) or clear ``straggler_at`` of ``ranks``; the ranks this caller changed."""
    if not ranks:
        return []
    now_p = connection.ops.adapt_datetimefield_value(now)
    marks = ", ".join(["%s"] * len(ranks))  # S608 below: only these placeholders are joined in
    if set_now:
        sql = (f"UPDATE jobs_rank SET straggler_at = %s WHERE job_id = %s AND rank IN ({marks}) "  # noqa: S608
               "AND straggler_at IS NULL RETURNING rank")
        params = [now_p, job_id, *ranks]
    else:
        sql = (f"UPDATE jobs_rank SET straggler_at = NULL WHERE job_id = %s AND rank IN ({marks}) "  # noqa: S608
               "AND straggler_at IS NOT NULL RETURNING rank")
        params = [job_id, *ranks]
    with connection.cursor() as cur:
        cur.execute(sql, params)
        return sorted(r[0] for r in cur.fetchall())


def straggler_spans(events: list[tuple[int, float, str]], *, end: float) -> list[tuple[int, float, float | None]]:
    """(rank, start, stop or None while it lasts) from ``(rank, at, state)`` straggler events in time order."""
    open_at: dict[int, float] = {}
    out: list[tuple[int, float, float | None]] = []
    for rank, at, state in events:
        if state == "marked":
            open_at.setdefault(rank, at)
        elif state == "cleared" and rank in open_at:
            out.append((rank, open_at.pop(rank), at))
    out += [(rank, at, None) for rank, at in open_at.items()]
    return [s for s in out if s[1] <= end]
