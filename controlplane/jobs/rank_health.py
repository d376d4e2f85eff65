"""The one place that decides a rank's health: the watchdog claims by it, the dashboard shows it.

A rank's facts live in two places while the Redis heartbeat store is on: its ``Rank`` row (claims, the
step clock; written only by the flush) and the store's newest beat, which may be up to a flush newer.
``current`` is the row as the flush will write it with that beat (the upsert's rules in
``rank_rows._UPSERT_TAIL``); ``Rank.health_at`` judges it against ``now``. Pure: no I/O.

Stragglers are the one judgement that needs the rank's peers: ``slowdowns`` compares each training
rank's own work per step (``busy_s``: CPU seconds of its training thread, averaged by the rank over the
job's straggler window; waits for peers left out, because lock-step collectives give every rank the same
wall step time) with the median of the other ranks'. A rank that is otherwise ok and more than the job's
``straggler_margin_pct`` above it is a straggler, with its slowdown in percent; it is ok again once its
windowed figure comes back under the margin.
"""

from __future__ import annotations

from datetime import datetime

from controlplane.jobs.heartbeats import RankState, Timeouts, utc
from controlplane.jobs.models import Rank, RankHealth
from controlplane.jobs.outages import grace_s
from trainer.wire import Phase


def current(row: Rank, fresh: RankState | None, timeouts: Timeouts, now: datetime) -> Rank:
    """``row`` moved forward to ``fresh`` (an unsaved copy), or ``row`` itself when ``fresh`` is not newer."""
    if fresh is None or (row.last_heartbeat_at is not None and fresh.at <= row.last_heartbeat_at.timestamp()):
        return row
    deadline = timeouts.deadline(fresh.phase, fresh.at)
    same_step = row.last_step == fresh.step
    d = row.__dict__.copy()  # a plain attribute copy: copy.copy goes through pickling (~100 us a rank)
    d.update(node=fresh.node, pid=fresh.pid, phase=fresh.phase, last_heartbeat_at=utc(fresh.at), loss=fresh.loss,
             step_time_s=fresh.step_time_s, tokens_per_s=fresh.tokens_per_s, last_step=fresh.step, busy_s=fresh.busy_s,
             stale_at=None if deadline is None else utc(deadline))
    if not (same_step and row.step_changed_at is not None):
        d["step_changed_at"] = utc(fresh.step_since)
    if fresh.phase != Phase.TRAIN:
        d["stall_at"] = None
    elif not (same_step and row.stall_at is not None):
        d["stall_at"] = utc(fresh.step_since + timeouts.stall_s)
    if deadline is None or deadline > now.timestamp():
        d["lost_at"] = None
    if not same_step:
        d["stalled_at"] = None
    r = Rank.__new__(Rank)
    r.__dict__ = d
    return r


def in_grace(row: Rank, windows: list[tuple[float, float]], now: datetime) -> bool:
    """The rank's deadline, moved by the control plane's own outage time after its last heartbeat
    (``windows``: ``outages.grace_windows``, which counts the time since the ingest beacon's last tick as
    outage), is still ahead."""
    if row.stale_at is None or not windows:
        return False
    t = now.timestamp()
    since = (row.last_heartbeat_at or row.stale_at).timestamp()
    return row.stale_at.timestamp() + grace_s(windows, since, t) >= t


def judge(row: Rank, now: datetime, windows: list[tuple[float, float]] = (),
          slowdown_pct: float | None = None) -> str:
    """``Rank.health_at``, except that a rank past its deadline only because the control plane itself was
    unavailable (outage grace) is late, not lost, until the watchdog claims it: what the page and the API
    show is what the watchdog will do. A rank that is ok and has a ``slowdown_pct`` (``slowdowns``) is a
    straggler."""
    h = row.health_at(now)
    if h == RankHealth.LOST and row.lost_at is None and in_grace(row, windows, now):
        return RankHealth.LATE
    if h == RankHealth.OK and slowdown_pct is not None:
        return RankHealth.STRAGGLER
    return h


def slowdowns(busy: dict[int, float], margin_pct: float) -> dict[int, float]:
    """{rank: slowdown in percent} for the ranks whose ``busy_s`` is more than ``margin_pct`` above the
    median of the other ranks' (``busy``: rank -> busy_s of the ranks in training). Needs two ranks;
    ``margin_pct`` 0 turns detection off. One sort, then each rank's "median of the others" by index."""
    n = len(busy)
    if n < 2 or margin_pct <= 0:
        return {}
    ordered = sorted(busy.items(), key=lambda kv: kv[1])
    values = [v for _, v in ordered]
    limit = 1 + margin_pct / 100
    out: dict[int, float] = {}
    m = n - 1  # the others' count
    # Only the top of the order can be above its peers' median by a positive margin: walk down from it.
    for i in range(n - 1, -1, -1):
        rank, v = ordered[i]

        def other(k: int, i: int = i) -> float:  # the k-th smallest value without index i
            return values[k if k < i else k + 1]

        median = other(m // 2) if m % 2 else (other(m // 2 - 1) + other(m // 2)) / 2
        if median <= 0 or v <= median * limit:
            break
        out[rank] = round((v / median - 1) * 100, 1)
    return out


def rank_health(row: Rank, fresh: RankState | None, timeouts: Timeouts, now: datetime,
                windows: list[tuple[float, float]] = ()) -> str:
    """A ``RankHealth`` value: the row with the store's newest beat, judged at ``now``."""
    return judge(current(row, fresh, timeouts, now), now, windows)


__all__ = ["current", "in_grace", "judge", "rank_health", "slowdowns"]
