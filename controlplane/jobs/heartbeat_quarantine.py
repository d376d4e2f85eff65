"""Heartbeat state the flush cannot write: the checks that name what is wrong with it, and the
``QuarantinedHeartbeat`` rows that keep it.

The flush (``jobs.redis_heartbeats``) writes per job and, when a slice fails, one rank at a time, each
state checked against the wire module's bounds (``wire.parse_heartbeat``) to name what is wrong. A state
that cannot be written (left in Redis by an older server that accepted unbounded values, or refused by
the database) is quarantined: logged, removed from Redis (only if unchanged), and kept as a
``QuarantinedHeartbeat`` row that ``/metrics`` counts and the job page shows.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime

import orjson
from django.db import transaction

from controlplane.jobs.rank_rows import RankState, beat_dict
from trainer import wire

log = logging.getLogger(__name__)


# States read back from Redis: storable values only (the ingest window does not apply: a rank's
# state may rightly be older than it; a state from beyond tomorrow was never a real clock reading).
def stored_window(world_size: int | None = None) -> wire.Window:
    return wire.Window(earliest=0.0, latest=time.time() + 86400.0, world_size=world_size)


def checked_state(raw: bytes, window: wire.Window | None = None) -> RankState:
    """A stored state, checked against the wire bounds; raises ``ValueError`` (a ``WireError`` naming
    the field, or a JSON error) when it cannot be written to a ``Rank`` row."""
    try:
        d = orjson.loads(raw[raw.find(b"|") + 1:])
        h = wire.parse_heartbeat(d, "state", window or stored_window())
    except TypeError as e:  # an unhashable value where a vocabulary word belongs
        raise ValueError(f"state: {e}") from e
    return RankState.of(beat_dict(h))


def unchecked_state(raw: bytes) -> RankState:
    """A stored state as written by this server's ingest (already within the wire bounds)."""
    return RankState.of(orjson.loads(raw[raw.find(b"|") + 1:]))


def why_unstorable(raw: bytes, window: wire.Window) -> str:
    try:
        checked_state(raw, window)
    except ValueError as e:
        return str(e)
    return "state: not a heartbeat state"


def printable(raw: bytes | str, limit: int) -> str:
    """Text a Postgres text column can hold (NULs escaped), truncated."""
    text = raw.decode("utf-8", "backslashreplace") if isinstance(raw, bytes) else raw
    return text.replace("\x00", "\\x00")[:limit]


def record_quarantine(job_id: int, rank: int | None, reason: str, payload: bytes | str, *, now: datetime) -> None:
    """Keep (count) a state the flush could not write, at most ``QuarantinedHeartbeat.PER_JOB`` rows per
    job (further ranks are counted on the job's ``rank=None`` row). Never raises: logged instead."""
    from django.db.models import F

    from controlplane.jobs.models import QuarantinedHeartbeat as Q

    reason, text = printable(reason, 1000), printable(payload, 2000)
    try:
        with transaction.atomic():
            fields = {"reason": reason, "payload": text, "at": now, "count": F("count") + 1}
            if Q.objects.filter(job_id=job_id, rank=rank).update(**fields):
                return
            if rank is not None and Q.objects.filter(job_id=job_id).count() >= Q.PER_JOB:
                rank = None
                if Q.objects.filter(job_id=job_id, rank=None).update(**fields):
                    return
            Q.objects.create(job_id=job_id, rank=rank, reason=reason, payload=text, at=now)
    except Exception:  # the log line is the record then
        log.exception("heartbeat flush: could not store the quarantine of job %s rank %s", job_id, rank)
