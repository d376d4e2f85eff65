"""The one place that decides a rank's health: the watchdog claims by it, the dashboard shows it.

A rank's facts live in two places while the Redis heartbeat store is on: its ``Rank`` row (claims, the
step clock; written only by the flush) and the store's newest beat, which may be up to a flush newer.
``current`` is the row as the flush will write it with that beat (the upsert's rules in
``heartbeats._UPSERT_TAIL``); ``Rank.health_at`` judges it against ``now``. Pure: no I/O.
"""

from __future__ import annotations

from datetime import datetime

from controlplane.jobs.heartbeats import RankState, Timeouts, utc
from controlplane.jobs.models import Rank
from trainer.wire import Phase


def current(row: Rank, fresh: RankState | None, timeouts: Timeouts, now: datetime) -> Rank:
    """``row`` moved forward to ``fresh`` (an unsaved copy), or ``row`` itself when ``fresh`` is not newer."""
    if fresh is None or (row.last_heartbeat_at is not None and fresh.at <= row.last_heartbeat_at.timestamp()):
        return row
    deadline = timeouts.deadline(fresh.phase, fresh.at)
    same_step = row.last_step == fresh.step
    d = row.__dict__.copy()  # a plain attribute copy: copy.copy goes through pickling (~100 us a rank)
    d.update(node=fresh.node, pid=fresh.pid, phase=fresh.phase, last_heartbeat_at=utc(fresh.at), loss=fresh.loss,
             step_time_s=fresh.step_time_s, tokens_per_s=fresh.tokens_per_s, last_step=fresh.step,
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


def rank_health(row: Rank, fresh: RankState | None, timeouts: Timeouts, now: datetime) -> str:
    """A ``RankHealth`` value: the row with the store's newest beat, judged at ``now``."""
    return current(row, fresh, timeouts, now).health_at(now)


__all__ = ["current", "rank_health"]
