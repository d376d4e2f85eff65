"""Where rank heartbeats go: the one seam between the ingest hot path and the ``Rank`` rows.

Two stores with one interface (``record``, ``flush``, ``overdue``, ``freshest``, ``forget``, ``drop_job``):

- ``DbHeartbeatStore`` (no ``REDIS_URL``): each batch upserts its ranks' rows inside the ingest
  transaction. Rank rows are always current.
- ``RedisHeartbeatStore`` (``REDIS_URL`` set): one Lua call per batch keeps, per job, the newest ``at``
  and state (the beat as JSON) by rank in two hashes, the job's progress (max step, first train beat),
  a global deadline ZSET and a dirty set. ``flush()`` (a Celery task the beat schedule runs every
  ``HEARTBEAT_FLUSH_INTERVAL_S``; the one writer of rows from Redis) upserts the dirty ranks' rows and the
  jobs' progress. The watchdog reads the deadline ZSET, so lost-rank detection does not wait for a flush.
  It lives in ``jobs.redis_heartbeats``, with the trade-offs it accepts; the states its flush cannot
  write go to ``jobs.heartbeat_quarantine``.

Both stores write rows with the same upsert (``upsert_ranks`` in ``jobs.rank_rows``, with the types and
deadlines it needs), which only ever moves a rank forward in time: a heartbeat older than the stored one
changes nothing.

This module holds the interface, the database store and the choice between the two (``get_store``).
"""

from __future__ import annotations

import threading
from datetime import datetime
from typing import Protocol

from django.conf import settings

from controlplane.jobs.heartbeat_quarantine import record_quarantine
from controlplane.jobs.rank_rows import (  # noqa: F401 - the stores' shared types, re-exported
    _TRAIN,
    _UPSERT_TAIL,
    RankState,
    Timeouts,
    beat_dict,
    first_train_at,
    newest_per_rank,
    update_job_progress,
    upsert_ranks,
    utc,
)
from controlplane.jobs.redis_heartbeats import RedisHeartbeatStore, flush_interval_s


class HeartbeatStore(Protocol):
    in_transaction: bool  # True: ``record`` must run inside the ingest transaction (it writes rows)

    def record(self, job_id: int, beats: list[dict], timeouts: Timeouts, *, now: datetime) -> None: ...

    def flush(self, *, now: datetime | None = None) -> int: ...

    def overdue(self, now: datetime, *, limit: int = 10000) -> list[tuple[int, int, float]]: ...

    def freshest(self, job_id: int, ranks: list[int]) -> dict[int, RankState]: ...

    def live_step(self, job_id: int) -> int | None: ...

    def forget(self, entries: list[tuple[int, int, float]]) -> None: ...

    def drop_job(self, job_id: int) -> None: ...


class DbHeartbeatStore:
    """Heartbeats straight into ``Rank`` rows, in the ingest transaction (the embedded default)."""

    in_transaction = True
    backstop_grace_s = 0.0  # the rows are the truth

    def record(self, job_id: int, beats: list[dict], timeouts: Timeouts, *, now: datetime) -> None:
        if not beats:
            return
        states = newest_per_rank(beats).values()
        upsert_ranks(job_id, states, timeouts, now=now)
        # The first train beat from every beat of the batch; the top step still from each rank's newest
        # (the Redis store takes it from every beat).
        first_train = first_train_at([b["at"] for b in beats], [b["phase"] for b in beats])
        update_job_progress(job_id, states, first_train=first_train)

    def flush(self, *, now: datetime | None = None) -> int:
        return 0

    def overdue(self, now: datetime, *, limit: int = 10000) -> list[tuple[int, int, float]]:
        return []  # the watchdog's database scan covers everything

    def freshest(self, job_id: int, ranks: list[int]) -> dict[int, RankState]:
        return {}

    def live_step(self, job_id: int) -> int | None:
        return None  # the job's row is written with each beat

    def forget(self, entries: list[tuple[int, int, float]]) -> None:
        pass

    def drop_job(self, job_id: int) -> None:
        pass


_store: HeartbeatStore | None = None
_store_lock = threading.Lock()


def get_store() -> HeartbeatStore:
    """The process's store: Redis when ``REDIS_URL`` is set, else the database."""
    global _store
    if _store is None:
        with _store_lock:
            if _store is None:
                url = getattr(settings, "REDIS_URL", "")
                _store = RedisHeartbeatStore(url) if url else DbHeartbeatStore()
    return _store


def set_store(store: HeartbeatStore | None) -> None:
    """Replace the process's store (tests; ``None`` = choose again from settings)."""
    global _store
    _store = store


__all__ = ["DbHeartbeatStore", "HeartbeatStore", "RankState", "RedisHeartbeatStore", "Timeouts",
           "flush_interval_s", "get_store", "newest_per_rank", "record_quarantine", "set_store",
           "update_job_progress", "upsert_ranks", "utc"]
