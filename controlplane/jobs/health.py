"""The one place that decides a rank's health: the watchdog claims by it, the dashboard shows it.

A rank's facts live in two places while the Redis heartbeat store is on: its ``Rank`` row (claims, the
step clock; written only by the flush) and the store's newest beat, which may be up to a flush newer.
``current`` is the row as the flush will write it with that beat (the upsert's rules in
``heartbeats._UPSERT_TAIL``); ``Rank.health_at`` judges it against ``now``. Pure: no I/O.
"""

from __future__ import annotations

import copy
from datetime import datetime

from controlplane.jobs.heartbeats import RankState, Timeouts, utc
from controlplane.jobs.models import Rank
from trainer.wire import Phase


def current(row: Rank, fresh: RankState | None, timeouts: Timeouts, now: datetime) -> Rank:
    """``row`` moved forward to ``fresh`` (an unsaved copy), or ``row`` itself when ``fresh`` is not newer."""
    if fresh is None or (row.last_heartbeat_at is not None and fresh.at <= row.last_heartbeat_at.timestamp()):
        return row
    r = copy.copy(row)
    deadline = timeouts.deadline(fresh.phase, fresh.at)
    same_step = row.last_step == fresh.step
    r.node, r.pid, r.phase = fresh.node, fresh.pid, fresh.phase
    r.last_heartbeat_at, r.loss = utc(fresh.at), fresh.loss
    r.step_time_s, r.tokens_per_s = fresh.step_time_s, fresh.tokens_per_s
    r.stale_at = None if deadline is None else utc(deadline)
    if not (same_step and row.step_changed_at is not None):
        r.step_changed_at = utc(fresh.step_since)
    if fresh.phase != Phase.TRAIN:
        r.stall_at = None
    elif not (same_step and row.stall_at is not None):
        r.stall_at = utc(fresh.step_since + timeouts.stall_s)
    if deadline is None or deadline > now.timestamp():
        r.lost_at = None
    if not same_step:
        r.stalled_at = None
    r.last_step = fresh.step
    return r


def rank_health(row: Rank, fresh: RankState | None, timeouts: Timeouts, now: datetime) -> str:
    """A ``RankHealth`` value: the row with the store's newest beat, judged at ``now``."""
    return current(row, fresh, timeouts, now).health_at(now)


__all__ = ["current", "rank_health"]
