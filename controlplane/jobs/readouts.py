"""The numbers the job page and the operator API both show (their readouts), computed in one place.

Each function turns stored facts into the numbers a reader sees (a fault's detection time, a save's
throughput, a rank's health with the freshest heartbeat). The dashboard formats them for people; the
operator API serialises them for scripts; neither recomputes them.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from django.db.models import Count, QuerySet

from controlplane.jobs import heartbeats, outages, rank_health
from controlplane.jobs.models import Event, Fault, Job, Rank, RankHealth, RestartCycle
from trainer.wire import CheckpointState, EventKind, Phase

# A rank in the job's world with no row yet (it has not reported).
UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class FaultFigures:
    layer: str | None  # the layer of the cycle that handled it (None: no cycle)
    escalated_to: str | None  # that cycle gave up and this later cycle recovered instead
    detection_s: float  # the cycle's detection latency when it has one, else the fault's own
    recovery_s: float | None  # the cycle's recovery time (None: no cycle, or still recovering)
    recovering: bool  # a cycle is attached, has not reached its first step, and the job still runs
    lost_steps: int | None  # steps recomputed because of this fault (the fault's own, else its cycle's)
    node: str  # the fault's node, else the node its rank reported (when ``rank_nodes`` is given)

    def as_dict(self) -> dict:
        return {"layer": self.layer, "escalated_to": self.escalated_to, "detection_s": self.detection_s,
                "recovery_s": self.recovery_s, "recovering": self.recovering, "lost_steps": self.lost_steps,
                "node": self.node}


def fault_figures(f: Fault, *, rank_nodes: dict[int, str] | None = None, ended: bool = False) -> FaultFigures:
    """Figures of one fault; ``f.cycle`` should be loaded with it (``select_related("cycle")``). Every
    view of a fault reads these: the fault table, the timeline's marker hover (its cycle's hover shows
    the same cycle's figures) and the operator API. ``rank_nodes`` (rank -> node, ``Job.rank_nodes()``)
    names the node when the fault did not. ``ended``: the job is over, so a cycle that never reached its
    first step is not recovering any more (it never will)."""
    c: RestartCycle | None = f.cycle
    detection = c.detection_s if c is not None and c.detection_s is not None else f.detection_s
    node = f.node or ((rank_nodes or {}).get(f.rank, "") if f.rank is not None else "")
    return FaultFigures(
        node=node,
        layer=c.layer if c is not None else None,
        escalated_to=(c.escalated_to or None) if c is not None else None,
        detection_s=detection,
        recovery_s=c.recovery_s if c is not None else None,
        recovering=c is not None and c.recovery_s is None and not ended,
        lost_steps=f.lost_steps if f.lost_steps is not None else (c.lost_steps if c is not None else None),
    )


TRACEBACK_HEAD = "Traceback (most recent call last):"


def traceback_in(message: str) -> str | None:
    """The Python traceback a fault's message carries (the trainer appends it to the error), if any."""
    i = message.find(TRACEBACK_HEAD)
    return message[i:] if i >= 0 else None


@dataclass(frozen=True, slots=True)
class CheckpointFigures:
    elapsed_s: float | None  # start to finish (None while in flight)
    durable_s: float | None  # start to durable (only for durable saves)
    mb_per_s: float | None  # write throughput (bytes / write time)


def checkpoint_figures(
    *, started_at: float, finished_at: float | None, state: str, write_s: float | None, nbytes: int | None
) -> CheckpointFigures:
    """Figures of one save, from its facts (times as unix seconds)."""
    # To the millisecond: the page reads times as SQL epochs and the API as datetimes, which differ in
    # the last microseconds.
    elapsed = round(max(0.0, finished_at - started_at), 3) if finished_at is not None else None
    return CheckpointFigures(
        elapsed_s=elapsed,
        durable_s=elapsed if state == CheckpointState.DURABLE else None,
        mb_per_s=(nbytes / write_s / 1e6) if nbytes and write_s else None,
    )


@dataclass(frozen=True, slots=True)
class ModeAdvice:
    """Async against sync for one job, from its durable saves (seconds per save, medians)."""

    async_cost_s: float  # what an async save cost the loop: blocked + slower steps
    async_blocking_s: float
    async_interference_s: float
    sync_s: float  # a sync save's cost: its blocked time
    sync_measured: bool  # True: from the job's own sync saves; False: estimated from async write times
    cheaper: str  # "sync" or "async"
    saves: int  # async saves the figures come from
    sync_saves: int = 0  # sync saves the sync figure comes from (0: estimated from the async saves)


# Advice from fewer saves than this of a kind is none: one sync save (the one a stop makes) against a
# handful of async ones said "sync costs this job less" on a job whose async saves were cheap.
MIN_ADVICE_SAVES = 3


def checkpoint_mode_advice(rows: Iterable[tuple[str, str, float | None, float | None, float | None]]
                           ) -> ModeAdvice | None:
    """Which mode costs this job's loop less per save, from ``(mode, state, blocking_s, write_s,
    interference_s)`` rows. An async save costs its blocked time plus its interference; a sync save
    its blocked time, taken from the job's own sync saves when it has any, else estimated as an async
    save's write time (start to durable: the same bytes written while competing with the steps, so at
    most what a sync save would block). Each figure is a median of at least ``MIN_ADVICE_SAVES`` saves:
    fewer sync saves than that are not used (the estimate is), fewer async ones give no advice."""
    asyncs, syncs, writes = [], [], []
    for mode, state, blocking_s, write_s, interference_s in rows:
        if state != CheckpointState.DURABLE:
            continue
        if mode == "sync" and blocking_s is not None:
            syncs.append(blocking_s)
        elif mode == "async" and interference_s is not None:
            asyncs.append((blocking_s or 0.0, interference_s))
            if write_s is not None:
                writes.append(write_s)
    if len(syncs) < MIN_ADVICE_SAVES:
        syncs = []
    if len(asyncs) < MIN_ADVICE_SAVES or not (syncs or len(writes) >= MIN_ADVICE_SAVES):
        return None
    blocking = statistics.median(b for b, _ in asyncs)
    interference = statistics.median(i for _, i in asyncs)
    cost = statistics.median(b + i for b, i in asyncs)
    sync_s = statistics.median(syncs or writes)
    return ModeAdvice(async_cost_s=cost, async_blocking_s=blocking, async_interference_s=interference,
                      sync_s=sync_s, sync_measured=bool(syncs), cheaper="sync" if cost > sync_s else "async",
                      saves=len(asyncs), sync_saves=len(syncs))


def checkpoint_counts(states: Iterable[str]) -> dict[str, int]:
    """Saves per state, every state named (0 when none)."""
    counts = {s.value: 0 for s in CheckpointState}
    for s in states:
        counts[s] = counts.get(s, 0) + 1
    return counts


def step_shown(job: Job) -> int:
    """The step the job page and the API show (``Job.step_shown``). While the job runs, the Redis store's
    step as of the newest beat: the row takes it only at the next flush, seconds later."""
    if job.is_active:
        try:
            live = heartbeats.get_store().live_step(job.pk)
        except Exception:  # noqa: BLE001 - the row is the fallback: a store hiccup must not break a reader
            live = None
        if live is not None:
            return live
    return job.step_shown


def progress_pct(job: Job, step: int | None = None) -> int:
    steps = job.job_spec.steps
    step = job.last_step if step is None else step
    return min(100, round(100 * step / steps)) if steps else 0


def restarts_by_layer(job_ids: Iterable[int]) -> dict[int, dict[str, int]]:
    """Restart cycles per job and layer: {job_id: {layer: count}} (jobs without cycles absent). A cycle a
    later one superseded (``escalated_to``: an in-process attempt that ft_launcher's in-job restart
    replaced) is not a restart of its own and is not counted."""
    out: dict[int, dict[str, int]] = {}
    rows = (RestartCycle.objects.filter(job_id__in=list(job_ids), escalated_to="")
            .values_list("job_id", "layer"))
    for job_id, layer, n in rows.annotate(n=Count("id")).order_by():
        out.setdefault(job_id, {})[layer] = n
    return out


@dataclass(frozen=True, slots=True)
class RankFigures:
    rank: int
    node: str
    health: str  # RankHealth at now, "stopped" once the job is over, UNKNOWN without a row
    hb_at: float | None  # the newest heartbeat (unix seconds), from Redis when it is newer than the row
    phase: str | None
    step: int | None
    loss: float | None
    step_time_s: float | None
    pid: int | None
    busy_s: float | None = None  # the rank's own work per step over the straggler window
    slowdown_pct: float | None = None  # a straggler's: its busy_s above the other ranks' median, in percent


def slowdowns(job: Job, rows: Iterable[Rank], now: datetime, *, complete: bool = False) -> dict[int, float]:
    """{rank: slowdown in percent} of the job's stragglers (``rank_health.slowdowns``), judged with ``rows``
    (already moved forward to the store's newest beats: ``rank_health.current``) and, unless ``complete`` says
    they are the whole world, the stored rows of the other ranks (one query; those lag Redis by up to a
    flush). A rank counts while it trains and ``Rank.health_at`` judges it ok or late (the other ranks'
    rows through ``Rank.objects.ok_or_late``, the same rule in SQL)."""
    margin = job.job_spec.straggler_margin_pct
    if not job.is_active or margin <= 0:
        return {}
    busy: dict[int, float] = {}
    if not complete:
        others = Rank.objects.filter(job=job).ok_or_late(now)
        busy = dict(others.filter(phase=Phase.TRAIN, busy_s__isnull=False).values_list("rank", "busy_s"))
    for r in rows:
        if r.phase == Phase.TRAIN and r.busy_s is not None and r.health_at(now) in (RankHealth.OK, RankHealth.LATE):
            busy[r.rank] = r.busy_s
        else:
            busy.pop(r.rank, None)
    return rank_health.slowdowns(busy, margin)


def slowdowns_of(job: Job, ranks: QuerySet, now: datetime) -> dict[int, float]:
    """``slowdowns`` judged with the stored rows of ``ranks`` (the whole world), read as numbers."""
    margin = job.job_spec.straggler_margin_pct
    if not job.is_active or margin <= 0:
        return {}
    busy = dict(ranks.ok_or_late(now).filter(phase=Phase.TRAIN, busy_s__isnull=False).values_list("rank", "busy_s"))
    return rank_health.slowdowns(busy, margin)


def freshest(job: Job, ranks: list[int]) -> dict:
    """Newer heartbeats than the Rank rows hold (the Redis store writes rows on its flush); {} otherwise."""
    try:
        return heartbeats.get_store().freshest(job.pk, ranks)
    except Exception:  # noqa: BLE001 - the rows are the fallback: a store hiccup must not break a reader
        return {}


def rank_figures(job: Job, rows: Iterable[Rank | tuple[int, None]], now: datetime) -> list[RankFigures]:
    """Figures of the given ranks, in the given order: a Rank row, or ``(rank, None)`` for a rank of the
    job's world that has no row yet. Heartbeat facts come from the store when it holds newer ones."""
    rows = list(rows)
    numbers = [r.rank if isinstance(r, Rank) else r[0] for r in rows]
    fresh = freshest(job, numbers) if job.is_active and numbers else {}
    timeouts = job.timeouts
    windows = outages.grace_windows(now) if job.is_active and numbers else []
    # Each row moved forward by the watchdog's own rule.
    moved = [rank_health.current(r, fresh.get(r.rank), timeouts, now) if isinstance(r, Rank) else r for r in rows]
    present = [r for r in moved if isinstance(r, Rank)]
    slow = slowdowns(job, present, now, complete=len(present) >= job.world_size) if present else {}
    out = []
    for r, n in zip(moved, numbers, strict=True):
        if not isinstance(r, Rank):
            out.append(RankFigures(rank=n, node="", health=UNKNOWN, hb_at=None, phase=None, step=None,
                                   loss=None, step_time_s=None, pid=None))
            continue
        hb_at = r.last_heartbeat_at.timestamp() if r.last_heartbeat_at else None
        pct = slow.get(r.rank)
        out.append(RankFigures(rank=r.rank, node=r.node,
                               health=rank_health.judge(r, now, windows, pct) if job.is_active else "stopped",
                               hb_at=hb_at, phase=r.phase, step=r.last_step, loss=r.loss,
                               step_time_s=r.step_time_s, pid=r.pid, busy_s=r.busy_s, slowdown_pct=pct))
    return out


def world(job: Job, rows: Iterable[Rank]) -> list[Rank | tuple[int, None]]:
    """Every rank of the job's world (and any reported beyond it), by rank number: the row, or
    ``(rank, None)`` where none exists yet."""
    by_rank = {r.rank: r for r in rows}
    return [by_rank.get(i, (i, None)) for i in sorted(set(range(job.world_size)) | set(by_rank))]


@dataclass(frozen=True, slots=True)
class Integration:
    level: int | None  # the highest integration level the ranks reported (None: none reported yet)
    versions: dict[str, str]  # sdk, torch, nvrx, python: from the newest report


def integration(job: Job) -> Integration | None:
    """How deeply a job's own code uses the SDK, from the ranks' ``integration`` events; None for the
    built-in model."""
    if not (job.spec or {}).get("entrypoint"):
        return None
    hellos = list(Event.objects.filter(job=job, kind=EventKind.INTEGRATION).order_by("-at")
                  .values_list("data", flat=True)[:64])
    levels = [h.get("level") for h in hellos if isinstance(h.get("level"), int)]
    latest = hellos[0] if hellos else {}
    versions = {k: str(latest[k]) for k in ("sdk", "torch", "nvrx", "python") if latest.get(k)}
    return Integration(level=max(levels) if levels else None, versions=versions)
