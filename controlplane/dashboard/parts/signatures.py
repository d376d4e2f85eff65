"""A cheap signature per part of the job page (and one for the job list), for cursor polling.

A page polls ``live`` with the signatures it has; the server recomputes them (a handful of indexed
aggregates, no row scans of the event log) and names only the parts whose signature moved, which
the page then fetches from their own fragment endpoints. Nothing unchanged is re-sent.
"""

from __future__ import annotations

import hashlib
import os
from datetime import datetime

from django.db.models import Count, Max, Q

from controlplane.dashboard import fleet
from controlplane.jobs import readouts
from controlplane.jobs.models import (
    AuditEntry,
    Checkpoint,
    Command,
    Event,
    Fault,
    Job,
    Outage,
    QuarantinedHeartbeat,
    Rank,
    RestartCycle,
)
from controlplane.jobs.policy import POLICY_EVENT
from trainer.wire import CheckpointState

JOB_SECTIONS = (
    "header",
    "actions",
    "timeline",
    "checkpoints",
    "faults",
    "goodput",
    "ranks",
    "progress",
    "commands",
    "audit",
    "log",
)


def _sig(*parts) -> str:
    return hashlib.blake2s(repr(parts).encode(), digest_size=6).hexdigest()


def job_signatures(job: Job, now: datetime) -> dict[str, str]:
    cyc = RestartCycle.objects.filter(job=job).aggregate(
        n=Count("id"),
        m=Max("id"),
        d=Count("detected_at"),
        a=Count("aborted_at"),
        r=Count("restarted_at"),
        lo=Count("checkpoint_loaded_at"),
        f=Count("first_step_at"),
        rs=Count("resumed_from_step"),
        sf=Count("step_at_fault"),
    )
    flt = Fault.objects.filter(job=job).aggregate(n=Count("id"), m=Max("id"))
    ck = Checkpoint.objects.filter(job=job).aggregate(
        n=Count("id"),
        m=Max("id"),
        d=Count("id", filter=Q(state=CheckpointState.DURABLE)),
        x=Count("id", filter=Q(state__in=(CheckpointState.FAILED, CheckpointState.ABANDONED))),
    )
    rk = Rank.objects.filter(job=job).aggregate(
        hb=Max("last_heartbeat_at"), lost=Count("lost_at"), stl=Count("stalled_at"), st=Max("step_changed_at")
    )
    cmd = Command.objects.filter(job=job).aggregate(
        n=Count("id"), m=Max("id"), done=Count("acked_at"), dl=Count("delivered_at")
    )
    aud = AuditEntry.objects.filter(job=job).aggregate(m=Max("id"))
    band = Outage.objects.filter(component__in=Outage.GRACE).aggregate(n=Count("id"), e=Count("ended_at"))
    qua = QuarantinedHeartbeat.objects.filter(job=job).aggregate(n=Count("id"), at=Max("at"))
    pol = Event.objects.filter(job=job, kind=POLICY_EVENT).aggregate(n=Count("id"), m=Max("id"))
    status = (
        job.status,
        job.status_reason,
        job.status_changed_at,
        job.attempt,
        job.first_step_at,
        job.finished_at,
    )
    cyc_s, flt_s, ck_s = tuple(cyc.values()), tuple(flt.values()), tuple(ck.values())
    rank_health = (rk["lost"], rk["stl"])
    # A large job's ranks beat all the time: its health part (a heatmap) refreshes at most every 2 s.
    rk_sig = (rank_health, int(now.timestamp() // 2)) if fleet.is_large(job) else tuple(rk.values())
    # Parts that move with time alone (goodput of a running job) refresh at most every 5 s.
    tick = int(now.timestamp() // 5) if job.is_active else 0
    return {
        "header": _sig(status, readouts.step_shown(job), tick),
        "actions": _sig(job.is_active, bool((job.launcher_state or {}).get("held"))),
        "timeline": _sig(status, cyc_s, flt_s, ck_s, rank_health, tuple(cmd.values()), tuple(band.values()),
                         tuple(pol.values())),
        "checkpoints": _sig(ck_s),
        "faults": _sig(flt_s, cyc_s, status, job.last_progress_at, tuple(pol.values())),
        "goodput": _sig(status, cyc_s, ck_s, job.last_step, tick),
        "ranks": _sig(rk_sig, tuple(qua.values())),
        "progress": _sig(ck_s, cyc_s, tick),
        "commands": _sig(tuple(cmd.values())),
        "audit": _sig(aud["m"]),
        "log": _sig(log_stat(job)),
    }


def log_stat(job: Job) -> tuple:
    path = (job.launcher_state or {}).get("log") if job.backend == "local" else None
    if not path:
        return ()
    try:
        st = os.stat(path)
    except OSError:
        return ()
    return (st.st_size, st.st_mtime_ns)


def jobs_signature(jobs: list[Job]) -> str:
    ids = [j.pk for j in jobs]
    extra = (
        Fault.objects.filter(job_id__in=ids).aggregate(m=Max("id"))["m"],
        RestartCycle.objects.filter(job_id__in=ids).aggregate(m=Max("id"), f=Count("first_step_at")),
        Checkpoint.objects.filter(job_id__in=ids, state=CheckpointState.DURABLE).aggregate(m=Max("id"))["m"],
    )
    return _sig([(j.pk, j.status, j.status_reason, j.last_step, j.status_changed_at) for j in jobs], extra)
