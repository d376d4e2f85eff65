"""The watchdog: derive lost, stalled and restart-storm states from stored facts and ``now``.

Every function here is safe to run in several workers at once: a state is claimed with a conditional
UPDATE (``... WHERE lost_at IS NULL``), and the fault it produces has a unique ``source_key``, so two
concurrent passes record one fault. A pass that dies half-way is simply repeated by the next one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import connection, transaction
from django.db.models import Count
from django.utils import timezone

from controlplane.jobs import attribution, notifications, outages, policy, rank_health, stragglers
from controlplane.jobs import heartbeats as hb_store
from controlplane.jobs.models import (
    ACTIVE_STATUSES,
    Fault,
    Job,
    JobStatus,
    Notification,
    Rank,
    RankHealth,
)
from controlplane.jobs.services import request_stop, set_status
from trainer.policy_rules import Action, Decision
from trainer.wire import FaultClass

log = logging.getLogger(__name__)
_CHUNK = 900  # ranks per claim statement (SQLite's variable limit is far above; keeps statements short)


@dataclass(slots=True)
class WatchdogResult:
    lost: int = 0
    stalled: int = 0
    storms: int = 0
    stragglers: int = 0
    policies: int = 0


def run_watchdog(now: datetime | None = None, *, store: hb_store.HeartbeatStore | None = None) -> WatchdogResult:
    """One pass of every check; a check that fails is logged and does not stop the others (each check
    also isolates its jobs from one another)."""
    now = now or timezone.now()
    result = WatchdogResult()
    try:  # first: a gap before this pass (or stopped ingest) is outage grace for the checks below
        outages.note_watchdog_pass(now)
        outages.check_ingest(now)
    except Exception:
        log.exception("watchdog: recording the control plane's outages failed")
    for name, check in (("lost", lambda: mark_overdue(now, store=store)), ("stalled", lambda: mark_stalled(now)),
                        ("storms", lambda: stop_storms(now)),
                        ("stragglers", lambda: stragglers.mark_stragglers(now)),
                        ("policies", lambda: policy.apply_policies(now))):
        try:
            setattr(result, name, check())
        except Exception:
            log.exception("watchdog: the %s check failed", name)
    try:
        outages.close_recovered(now, redis_ok=not outages.is_down(outages.Component.REDIS))
    except Exception:
        log.exception("watchdog: closing recovered outages failed")
    return result


def _claim(column: str, job_id: int, ranks: list[int], now: datetime, condition: str) -> list[int]:
    """``UPDATE jobs_rank SET <column> = now WHERE ... AND <condition> RETURNING rank``: the ranks this
    caller claimed (a concurrent caller blocks on the row lock, then sees the column set: 0 rows)."""
    now_p = connection.ops.adapt_datetimefield_value(now)
    out: list[int] = []
    with connection.cursor() as cur:
        for i in range(0, len(ranks), _CHUNK):
            part = ranks[i:i + _CHUNK]
            # S608: column and condition are literals in this module's calls; the values are parameters.
            cur.execute(f"UPDATE jobs_rank SET {column} = %s WHERE job_id = %s AND rank IN "  # noqa: S608
                        f"({', '.join(['%s'] * len(part))}) AND {condition} RETURNING rank",
                        [now_p, job_id, *part, now_p])
            out += [r[0] for r in cur.fetchall()]
    return out


def mark_overdue(now: datetime | None = None, *, store: hb_store.HeartbeatStore | None = None) -> int:
    """Record a ``heartbeat_lost`` fault, once, for every rank of an active job past its deadline.

    1. Candidates: the heartbeat store's deadline index (Redis: fresh to the last batch) and the
       database rows (``Rank.objects.overdue``: covers the database store, and with Redis, a Redis
       that restarted empty or a fallback to the database; then a grace of two flush intervals
       applies, so such a loss is found up to ``backstop_grace_s`` late).
    2. Per job, judge each candidate by ``rank_health.rank_health`` (its row with the store's freshest beat),
       so a rank that beat after the last flush is not claimed. The watchdog writes no heartbeat rows.
    3. Claim ``lost_at`` with a conditional UPDATE; insert one fault per claimed rank (``source_key`` =
       rank + deadline); both in one transaction.
    4. After the commit, drop the settled entries from the store's index (only if unchanged since read).
    Returns the number of ranks this call marked lost.
    """
    now = now or timezone.now()
    store = store or hb_store.get_store()
    try:
        indexed = store.overdue(now)
        outages.dependency_ok(outages.Component.REDIS)
    except Exception as e:  # noqa: BLE001 - a Redis outage: the database scan below still works
        outages.dependency_failed(outages.Component.REDIS,
                                  f"heartbeat store: {e}; the watchdog reads the rows")
        indexed = []
    by_job: dict[int, set[int]] = {}
    for j, r, _ in indexed:
        by_job.setdefault(j, set()).add(r)
    # The rows lag a Redis store by up to a flush; scanning them without a grace would make every pass
    # re-check (and re-write) thousands of live ranks whenever a flush runs late.
    grace = timedelta(seconds=getattr(store, "backstop_grace_s", 0.0))
    for j, r in Rank.objects.overdue(now - grace).values_list("job_id", "rank")[:10000]:
        by_job.setdefault(j, set()).add(r)
    if not by_job:
        return 0
    jobs = {j.pk: j for j in Job.objects.filter(pk__in=list(by_job))}
    windows = outages.grace_windows(now)
    settled: set[tuple[int, int]] = set()
    n = 0
    for job_id in sorted(by_job):
        job = jobs.get(job_id)
        if job is None or not job.is_active:
            try:
                store.drop_job(job_id)
            except Exception:
                log.warning("watchdog: could not drop heartbeat state of job %s", job_id, exc_info=True)
            continue
        try:
            claimed, done = _mark_job_lost(job, sorted(by_job[job_id]), now, store, windows=windows)
            n += claimed
            settled |= {(job_id, r) for r in done}
        except Exception:  # one job's failure must not stop the others' detection
            log.exception("watchdog: marking lost ranks of job %s failed", job_id)
    entries = [e for e in indexed if (e[0], e[1]) in settled]
    if entries:
        try:
            store.forget(entries)
        except Exception:  # the next pass sees them again; claims make that harmless
            log.warning("watchdog: could not forget handled deadlines", exc_info=True)
    return n


def _mark_job_lost(job: Job, ranks: list[int], now: datetime, store: hb_store.HeartbeatStore, *,
                   windows: list[tuple[float, float]] = ()) -> tuple[int, set[int]]:
    """Record a fault for, and claim, the ranks that ``rank_health.rank_health`` finds lost (by the store's
    freshest beat: the rows are the flush's to write, never the watchdog's). Returns (faults recorded,
    ranks settled). A lost rank whose row the flush has not written yet gets its fault now (its
    ``source_key`` is rank + deadline, so it is recorded once) and stays unsettled: its index entry is
    kept, and a later pass claims the row once the flush has written it.

    Outage grace (``windows``, from ``outages.grace_windows``, the time since the ingest beacon's last
    tick included): a rank's deadline moves by the outage time after its last heartbeat; a rank past its
    deadline but inside that grace is not lost yet and stays unsettled (indexed), so a later pass judges
    it again; so does a rank whose deadline is exactly ``now``."""
    try:
        fresh = store.freshest(job.pk, ranks)
    except Exception as e:  # noqa: BLE001 - Redis down: judge by the rows (heartbeats fall back to them)
        outages.dependency_failed(outages.Component.REDIS,
                                  f"heartbeat store: {e}; the watchdog reads the rows")
        fresh = {}
    timeouts = job.timeouts
    rows = {r.rank: r for r in Rank.objects.filter(job=job, rank__in=ranks)}
    views = {r: rank_health.current(rows.get(r) or Rank(job=job, rank=r), fresh.get(r), timeouts, now)
             for r in ranks}
    lost = sorted(r for r, v in views.items() if v.lost_at is None and v.health_at(now) == RankHealth.LOST)
    graced = {r for r in lost if views[r].stale_at is not None and rank_health.in_grace(views[r], windows, now)}
    lost = [r for r in lost if r not in graced]
    # Settled: every rank but those whose deadline is not ahead and that this call did not claim (graced,
    # not claimable yet, or due exactly at ``now``: the index returns deadlines <= now, and a deadline
    # equal to now is not passed yet). Forgetting those would leave them to the database scan, a
    # ``backstop_grace_s`` later.
    waiting = {r for r, v in views.items()
               if v.lost_at is None and v.stale_at is not None and v.stale_at <= now}
    if not lost:
        return 0, set(ranks) - waiting
    with transaction.atomic():
        # The row's own deadline must have passed too: a flush that wrote a newer beat meanwhile wins.
        claimed = set(_claim("lost_at", job.pk, lost, now, "lost_at IS NULL AND stale_at < %s"))
        faults = {}
        progress = Job.last_progress_of(job.pk)  # read once for every lost rank
        for rank in lost:
            r = views[rank]
            age = (now - r.last_heartbeat_at).total_seconds() if r.last_heartbeat_at else 0.0
            key = f"heartbeat_lost:{rank}:{int(r.stale_at.timestamp() * 1000) if r.stale_at else 0}"
            faults[key] = Fault(
                job=job, fault_class=FaultClass.HEARTBEAT_LOST, rank=rank, node=r.node,
                detected_by="watchdog",
                message=f"no heartbeat from rank {rank} for {age:.1f} s (phase {r.phase}, "
                        f"deadline {r.stale_at.isoformat() if r.stale_at else '-'})",
                at=r.last_heartbeat_at or now, detected_at=now, source_key=key,
                progress_at=Fault.clip_progress(progress, r.last_heartbeat_at or now))
        known = set(Fault.objects.filter(job=job, source_key__in=list(faults))
                    .values_list("source_key", flat=True))
        new = [f for k, f in faults.items() if k not in known]
        Fault.objects.bulk_create(new, ignore_conflicts=True)
        if new:
            attribution.attribute(job, [f.at for f in new])
    if new:
        log.warning("job %s: %d rank(s) lost (first: %s)", job.pk, len(new), sorted(f.rank for f in new)[:5])
    return len(new), (set(ranks) - waiting) | claimed


def mark_stalled(now: datetime | None = None) -> int:
    """Ranks that keep beating while their step does not move for ``stall_timeout_s``: a ``stalled``
    fault once per rank and stuck step, and one notification per job and stall.

    Reads ``Rank`` rows, so with the Redis store it lags by one flush interval (seconds, against a
    stall timeout of minutes)."""
    now = now or timezone.now()
    by_job: dict[int, list[int]] = {}
    for j, r in Rank.objects.stalled(now).values_list("job_id", "rank")[:10000]:
        by_job.setdefault(j, []).append(r)
    n = 0
    for job_id, ranks in sorted(by_job.items()):
        try:
            n += _mark_job_stalled(job_id, ranks, now)
        except Exception:  # one job's failure must not stop the others' detection
            log.exception("watchdog: marking stalled ranks of job %s failed", job_id)
    return n


def _mark_job_stalled(job_id: int, ranks: list[int], now: datetime) -> int:
    with transaction.atomic():
        claimed = _claim("stalled_at", job_id, sorted(ranks), now,
                         "stalled_at IS NULL AND lost_at IS NULL AND stall_at < %s")
        if not claimed:
            return 0
        job = Job.objects.get(pk=job_id)
        rows = []
        for r in Rank.objects.filter(job_id=job_id, rank__in=claimed):
            since = r.step_changed_at or now
            rows.append(Fault(
                job=job, fault_class=FaultClass.STALLED, rank=r.rank, node=r.node, detected_by="watchdog",
                message=f"rank {r.rank} is alive but has been at step {r.last_step} for "
                        f"{(now - since).total_seconds():.0f} s (phase {r.phase})",
                at=since, detected_at=now,
                progress_at=Fault.clip_progress(job.last_progress_at, since),
                source_key=f"stalled:{r.rank}:{int(since.timestamp() * 1000)}"))
        Fault.objects.bulk_create(rows, ignore_conflicts=True)
        attribution.attribute(job, [f.at for f in rows])
        step = min(r.last_step for r in Rank.objects.filter(job_id=job_id, rank__in=claimed))
        progress = job.last_progress_at.timestamp() if job.last_progress_at else 0.0
        notifications.enqueue(
            job, Notification.Transition.STALLED, f"stalled:{progress:.3f}",
            f"Job #{job.pk} {job.name} is stalled: {len(claimed)} rank(s) alive but stuck at step {step} "
            f"for over {job.job_spec.stall_timeout_s:.0f} s.", now=now)
    return len(claimed)


def stop_storms(now: datetime | None = None) -> int:
    """K restart cycles (``spec.storm_restarts``) started since the job last made step progress (its
    ``max_step`` last grew): fail the job with a reason and ask the launcher to stop it. Returns the
    number of jobs stopped."""
    now = now or timezone.now()
    counts = (policy.storm_cycles().filter(job__status__in=(JobStatus.RUNNING, JobStatus.RECOVERING))
              .values("job").annotate(n=Count("id")).values_list("job", "n"))
    stopped = 0
    for job_id, count in counts:
        try:
            stopped += _stop_storm(job_id, count, now)
        except Exception:  # one job's failure must not stop the others' checks
            log.exception("watchdog: the restart-storm check of job %s failed", job_id)
    return stopped


def _stop_storm(job_id: int, count: int, now: datetime) -> int:
    job = Job.objects.get(pk=job_id)
    limit = job.job_spec.storm_restarts
    if count < limit:
        return 0
    reason = (f"restart storm: {count} restarts without step progress past step {job.max_step} "
              f"(storm_restarts={limit})") + _storm_cause(job)
    with transaction.atomic():
        if not set_status(job, JobStatus.FAILED, reason, only_from=(JobStatus.RUNNING, JobStatus.RECOVERING)):
            return 0
        notifications.enqueue(job, Notification.Transition.STORM, "storm",
                              f"Job #{job.pk} {job.name} stopped: {reason}.", now=now)
        policy.record(job, Decision(Action.STOP, None, f"default: {reason}"), key=f"storm-{job.attempt}",
                      subject="restart storm", rank=None, now=now)
        request_stop(job.pk, reason=reason)
    log.error("job %s: %s", job.pk, reason)
    return 1



def _storm_cause(job: Job) -> str:
    """The fault the storm repeats, named: ", each time fault 12 (exception on rank 1: ...)"."""
    root = (Fault.objects.filter(job=job, primary__isnull=True, count__gt=1).order_by("-at", "-id").first()
            or Fault.objects.filter(job=job, primary__isnull=True).order_by("-at", "-id").first())
    if root is None:
        return ""
    head = (root.message or "").split("\n", 1)[0][:120]
    times = f"{root.count} times: " if root.count > 1 else ""
    return f"; {times}fault {root.pk} ({policy.fault_subject(root)}" + (f": {head}" if head else "") + ")"


__all__ = ["ACTIVE_STATUSES", "WatchdogResult", "mark_overdue", "mark_stalled", "request_stop", "run_watchdog",
           "stop_storms"]
