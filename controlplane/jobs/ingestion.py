"""Facts in: store a validated batch (``trainer.wire.Batch``) and derive facts from its new events.

Plain functions, no HTTP: ``wire.parse_batch`` validates (the one definition of the wire format and
its bounds), ``parse_heartbeats_fast`` is the hot path's unrolled validator for heartbeat-only batches
(same rules, same constants), and ``record_batch`` writes. The ingest view is a thin adapter around them.

1. Events are inserted with ``ON CONFLICT (job_id, event_id) DO NOTHING RETURNING event_id``; facts
   are derived only from the rows this call inserted, so a retried or duplicated batch changes nothing.
2. Facts are derived from the new events by ``jobs.event_facts`` (restart cycles by
   ``jobs.restart_cycles``). Derived facts are monotone, so out-of-order arrival does not matter: cycle
   marks keep the earliest timestamp, checkpoint states only leave ``in_flight``, command acks only leave
   pending/delivered, rank rows only move forward in heartbeat time.
3. Everything for the database happens in ONE transaction. With the Redis heartbeat store, heartbeats
   go to Redis after that commit; if Redis is unreachable they go to the database instead (a second
   short transaction), so a Redis outage neither loses heartbeats nor blinds the watchdog. If that
   fails too, ``PartlyStored`` says what the committed transaction holds (the view answers 503 with
   it); anything raised before the commit rolled everything back.
4. The training sample (``_maybe_sample``) is best effort: it never fails or partly fails a batch.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connection, transaction

from controlplane.jobs import heartbeats as hb_store
from controlplane.jobs import outages
from controlplane.jobs.event_facts import OPEN_COMMANDS, apply_events
from controlplane.jobs.models import Command, CommandStatus, Event, Job, JobStatus, TrainingSample
from controlplane.jobs.services import set_status
from trainer.wire import (
    DEFAULT_MAX_AGE_S,
    MAX_CLOCK_SKEW_S,
    MAX_FUTURE_S,
    MAX_HEARTBEATS,
    MAX_SOURCE_LEN,
    WIRE_VERSION,
    Batch,
    Phase,
    Window,
    heartbeats_ok,
)

log = logging.getLogger(__name__)

_NUMBER = frozenset({int, float})


@dataclass(slots=True)
class IngestResult:
    heartbeats: int
    events: int  # newly stored
    duplicates: int  # already stored (a retry)

    def to_wire(self) -> dict[str, int]:
        return {"heartbeats": self.heartbeats, "events": self.events, "duplicates": self.duplicates}


# --- writing -------------------------------------------------------------------------------------------


def parse_heartbeats_fast(obj: Any, *, now: float, world_size: int,
                          max_age_s: float = DEFAULT_MAX_AGE_S) -> list[dict] | None:
    """The hot path's validator for the common batch: heartbeats only, known keys only.

    Returns the heartbeat dicts when they are certainly valid (the same rules and bound constants as
    ``wire.parse_batch``, checked column-wise: ~5x cheaper than building ``Heartbeat`` objects), else
    ``None``: the caller then runs ``wire.parse_batch``, which accepts or names the offending field.
    Never accepts what ``parse_batch`` refuses (tests/controlplane/jobs/test_ingestion.py compares the
    two on mutated batches). Input is orjson's: numbers are finite, strings valid Unicode.
    """
    if type(obj) is not dict or obj.get("events"):
        return None
    v = obj.get("v", WIRE_VERSION)
    if type(v) is not int or v != WIRE_VERSION:
        return None
    sent_at = obj.get("sent_at")
    hbs = obj.get("heartbeats")
    source = obj.get("source", "")
    if (type(sent_at) not in _NUMBER or abs(sent_at - now) > MAX_CLOCK_SKEW_S or type(hbs) is not list
            or len(hbs) > MAX_HEARTBEATS or type(source) is not str or len(source) > MAX_SOURCE_LEN
            or "\x00" in source or ("events" in obj and type(obj["events"]) is not list)):
        return None
    if not hbs:
        return hbs
    window = Window(earliest=now - max_age_s, latest=sent_at + MAX_FUTURE_S, world_size=world_size)
    return hbs if heartbeats_ok(hbs, window) else None


def record_batch(job: Job, batch: Batch, *, now: datetime,
                 store: hb_store.HeartbeatStore | None = None) -> IngestResult:
    """Store ``batch`` for ``job`` (already authorised and validated by ``wire.parse_batch``)."""
    return _record(job, [hb_store.beat_dict(h) for h in batch.heartbeats], batch.events, batch.source,
                   now=now, store=store)


def record_heartbeats(job: Job, beats: list[dict], *, now: datetime,
                      store: hb_store.HeartbeatStore | None = None) -> IngestResult:
    """Store heartbeat dicts accepted by ``parse_heartbeats_fast`` (a batch without events)."""
    return _record(job, beats, [], "", now=now, store=store)


class PartlyStored(Exception):
    """The batch's database transaction committed, then its heartbeats could be stored nowhere (the
    heartbeat store failed and so did the database fallback). ``stored`` says what is kept; a retry
    of the whole batch is safe (events are stored once, heartbeats only move forward)."""

    def __init__(self, stored: dict[str, bool], cause: Exception):
        super().__init__(f"stored {stored}: {cause}")
        self.stored = stored


def _record(job: Job, beats: list[dict], events: list[Any], source: str, *, now: datetime,
            store: hb_store.HeartbeatStore | None) -> IngestResult:
    store = store or hb_store.get_store()
    timeouts = job.timeouts
    n_new = 0
    launching = job.status in (JobStatus.PENDING, JobStatus.LAUNCHING)
    if events or (beats and (store.in_transaction or launching)):
        with transaction.atomic():
            if events:
                new = _insert_events(job, events, source, now)
                n_new = len(new)
                if new:
                    apply_events(job, new, now=now)
            if beats:
                if store.in_transaction:
                    store.record(job.pk, beats, timeouts, now=now)
                if launching:
                    _maybe_running(job, beats)
    if beats and not store.in_transaction:
        try:
            store.record(job.pk, beats, timeouts, now=now)
            outages.dependency_ok(outages.Component.REDIS)
        except Exception as e:  # noqa: BLE001 - any store failure: keep the facts in the database instead
            outages.dependency_failed(outages.Component.REDIS,
                                      f"heartbeat store: {e}; ingest writes heartbeats to the database")
            try:
                with transaction.atomic():
                    hb_store.DbHeartbeatStore().record(job.pk, beats, timeouts, now=now)
            except Exception as e2:
                log.error("job %s: heartbeats stored nowhere (store: %s; database: %s)", job.pk, e, e2)
                raise PartlyStored({"events": bool(events), "heartbeats": False}, e2) from e2
    if beats:
        _maybe_sample(job, beats, now)
    return IngestResult(heartbeats=len(beats), events=n_new, duplicates=len(events) - n_new)


SAMPLE_INTERVAL_S = 2.0
_last_sample: dict[int, float] = {}  # job id -> beat time of this process's last sample (a cheap pre-check)
sample_failures = 0  # training samples this process could not store (logged each time)


def _maybe_sample(job: Job, beats: list[dict], now: datetime) -> None:
    """Keep one heartbeat (the lowest rank's) every SAMPLE_INTERVAL_S of beat time per job, across every
    web process: the job row's lock orders the processes, and a sample is written only when the job has
    none within the interval. Samples are placed by the trainer's clock (the beat's ``at``), not arrival,
    and every beat of the batch is a candidate: beats replayed late from a trainer's spool fill the
    places of when they happened. Best effort: runs after the batch is stored and never raises, so it can
    neither fail the batch nor turn a stored batch into an error."""
    global sample_failures
    try:
        train = sorted((b for b in beats if b["phase"] == Phase.TRAIN), key=lambda b: (b["rank"], b["at"]))
        if not train:
            return
        last = _last_sample.get(job.pk, -1e18)
        low = train[0]["rank"]
        picks = [b for b in train if b["rank"] == low and abs(b["at"] - last) >= SAMPLE_INTERVAL_S]
        if not picks:
            return
        with transaction.atomic():  # a savepoint inside a caller's transaction: a failure leaves it usable
            list(Job.objects.select_for_update().filter(pk=job.pk).values_list("pk"))
            lo, hi = picks[0]["at"] - SAMPLE_INTERVAL_S, picks[-1]["at"] + SAMPLE_INTERVAL_S
            taken = [t.timestamp() for t in TrainingSample.objects.filter(
                job_id=job.pk, at__gt=hb_store.utc(lo), at__lt=hb_store.utc(hi)).values_list("at", flat=True)]
            rows = []
            for b in picks:
                if any(abs(b["at"] - t) < SAMPLE_INTERVAL_S for t in taken):
                    continue
                taken.append(b["at"])
                rows.append(TrainingSample(job_id=job.pk, at=hb_store.utc(b["at"]), rank=b["rank"],
                                           step=b["step"], loss=b.get("loss"),
                                           step_time_s=b.get("step_time_s"),
                                           tokens_per_s=b.get("tokens_per_s")))
            _last_sample[job.pk] = max(last, picks[-1]["at"])
            TrainingSample.objects.bulk_create(rows)
    except Exception:  # a chart point is not worth an error answer
        sample_failures += 1
        log.warning("could not store a training sample for job %s (%d so far)", job.pk, sample_failures,
                    exc_info=True)


def _maybe_running(job: Job, beats: list[dict]) -> None:
    """LAUNCHING -> RUNNING on the first train heartbeat (checked only while the job is launching)."""
    if any(b["phase"] == Phase.TRAIN for b in beats):
        set_status(job, JobStatus.RUNNING, "training", only_from=(JobStatus.PENDING, JobStatus.LAUNCHING))


def _insert_events(job: Job, batch_events: list[Any], source: str, now: datetime) -> list[Any]:
    """Insert the batch's events; return those that were new (each retried id is skipped)."""
    seen: set[str] = set()
    events = []
    for e in batch_events:  # one id twice in one batch: the first wins
        if e.id not in seen:
            seen.add(e.id)
            events.append(e)
    if connection.vendor == "postgresql":
        # Five arrays instead of eight placeholders per event: the statement is the same text for
        # every batch (cheap for the driver to prepare), whatever the batch's size.
        sql = ("INSERT INTO jobs_event (job_id, event_id, kind, rank, at, received_at, source, data) "
               "SELECT %s, t.event_id, t.kind, t.rank, t.at, %s, %s, t.data::jsonb FROM unnest("
               "%s::varchar[], %s::varchar[], %s::integer[], %s::timestamptz[], %s::text[]) "
               "AS t(event_id, kind, rank, at, data) ON CONFLICT (job_id, event_id) DO NOTHING RETURNING event_id")
        params: list = [job.pk, now, source, [e.id for e in events], [e.kind for e in events],
                        [e.rank for e in events], [hb_store.utc(e.at) for e in events],
                        [json.dumps(e.data) for e in events]]
    else:
        adapt = connection.ops.adapt_datetimefield_value
        data_field = Event._meta.get_field("data")
        received = adapt(now)
        params = []
        for e in events:
            params += (job.pk, e.id, e.kind, e.rank, adapt(hb_store.utc(e.at)), received, source,
                       data_field.get_db_prep_save(e.data, connection))
        # S608: only placeholders are joined into the SQL; the values are parameters.
        sql = ("INSERT INTO jobs_event (job_id, event_id, kind, rank, at, received_at, source, data) VALUES "  # noqa: S608
               + ", ".join(["(%s, %s, %s, %s, %s, %s, %s, %s)"] * len(events))
               + " ON CONFLICT (job_id, event_id) DO NOTHING RETURNING event_id")
    with connection.cursor() as cur:
        cur.execute(sql, params)
        inserted = {row[0] for row in cur.fetchall()}
    return [e for e in events if e.id in inserted]


# --- commands down ---------------------------------------------------------------------------------------


def pending_commands(job_id: int, *, now: datetime) -> list[dict]:
    """The job's trainer-bound commands not yet acknowledged, oldest first; marks first deliveries."""
    cmds = list(Command.objects.filter(job_id=job_id, via_trainer=True, status__in=OPEN_COMMANDS)
                .order_by("issued_at", "id"))
    fresh = [c.pk for c in cmds if c.status == CommandStatus.PENDING]
    if fresh:
        Command.objects.filter(pk__in=fresh, status=CommandStatus.PENDING).update(
            status=CommandStatus.DELIVERED, delivered_at=now)
    return [c.to_wire() for c in cmds]
