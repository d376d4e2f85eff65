"""Facts in: store a validated batch (``trainer.wire.Batch``) and derive facts from its new events.

Plain functions, no HTTP: ``wire.parse_batch`` validates (the one definition of the wire format and
its bounds), ``parse_heartbeats_fast`` is the hot path's unrolled validator for heartbeat-only batches
(same rules, same constants), and ``record_batch`` writes. The ingest view is a thin adapter around them.

1. Events are inserted with ``ON CONFLICT (job_id, event_id) DO NOTHING RETURNING event_id``; facts
   are derived only from the rows this call inserted, so a retried or duplicated batch changes nothing.
2. Derived facts are monotone, so out-of-order arrival does not matter: cycle marks keep the earliest
   timestamp, checkpoint states only leave ``in_flight``, command acks only leave pending/delivered,
   rank rows only move forward in heartbeat time.
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
from django.db.models import Q

from controlplane.jobs import attribution
from controlplane.jobs import heartbeats as hb_store
from controlplane.jobs import notifications, outages
from controlplane.jobs.models import (
    Checkpoint,
    Command,
    CommandStatus,
    Event,
    Fault,
    Job,
    JobStatus,
    Notification,
    RestartCycle,
    TrainingSample,
)
from controlplane.jobs.services import freshest_step, set_status
from trainer.wire import (
    DEFAULT_MAX_AGE_S,
    MAX_CLOCK_SKEW_S,
    MAX_FUTURE_S,
    MAX_HEARTBEATS,
    MAX_SOURCE_LEN,
    WIRE_VERSION,
    Batch,
    CheckpointMode,
    CheckpointState,
    CycleMark,
    EventKind,
    Layer,
    Phase,
    Window,
    heartbeats_ok,
    redact,
)

log = logging.getLogger(__name__)

_FINAL_CKPT = (CheckpointState.DURABLE, CheckpointState.FAILED, CheckpointState.ABANDONED)
_OPEN_COMMANDS = (CommandStatus.PENDING, CommandStatus.DELIVERED)
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
    except Exception:  # noqa: BLE001 - a chart point is not worth an error answer
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
        sql = ("INSERT INTO jobs_event (job_id, event_id, kind, rank, at, received_at, source, data) VALUES "
               + ", ".join(["(%s, %s, %s, %s, %s, %s, %s, %s)"] * len(events))
               + " ON CONFLICT (job_id, event_id) DO NOTHING RETURNING event_id")
    with connection.cursor() as cur:
        cur.execute(sql, params)
        inserted = {row[0] for row in cur.fetchall()}
    return [e for e in events if e.id in inserted]


def apply_events(job: Job, events: list[Any], *, now: datetime) -> None:
    """Derive cycles, faults, checkpoints and command acks from newly stored events (in timestamp order)."""
    events = sorted(events, key=lambda e: e.at)
    by_kind: dict[str, list[Any]] = {}
    for e in events:
        by_kind.setdefault(e.kind, []).append(e)
    cycles = _apply_cycles(job, by_kind.get(EventKind.CYCLE, []), by_kind.get(EventKind.FAULT, []), now)
    _apply_faults(job, by_kind.get(EventKind.FAULT, []), cycles)
    for e in by_kind.get(EventKind.CHECKPOINT, []):
        _apply_checkpoint(job, e)
    for e in by_kind.get(EventKind.COMMAND_ACK, []):
        d = e.data
        Command.objects.filter(job=job, pk=d["command_id"], status__in=_OPEN_COMMANDS).update(
            status=CommandStatus.ACKED if d["ok"] else CommandStatus.FAILED, acked_at=hb_store.utc(e.at),
            detail=str(d.get("detail") or "")[:2000])


def _apply_cycles(job: Job, cycle_events: list[Any], fault_events: list[Any],
                  now: datetime) -> dict[str, RestartCycle]:
    """Upsert the cycles these events name; keep each mark's earliest time; move the job's status."""
    marks: dict[str, dict[str, datetime]] = {}
    layers: dict[str, str] = {}
    resumed: dict[str, int] = {}
    first_steps: dict[str, int] = {}
    at_fault: dict[str, int] = {}
    reasons: dict[str, str] = {}
    commands: dict[str, int] = {}
    restored: dict[str, str] = {}
    for e in cycle_events:
        key, mark, at = e.data["cycle"], e.data["mark"], hb_store.utc(e.at)
        m = marks.setdefault(key, {})
        if mark not in m or at < m[mark]:
            m[mark] = at
        if e.data.get("layer"):
            layers.setdefault(key, e.data["layer"])
        if e.data.get("command_id") is not None:
            commands.setdefault(key, e.data["command_id"])
        step = e.data.get("step")
        if step is not None:
            if mark in (CycleMark.CHECKPOINT_LOADED, CycleMark.RESTARTED):
                resumed[key] = step if mark == CycleMark.CHECKPOINT_LOADED else resumed.get(key, step)
            elif mark == CycleMark.FAULT:
                at_fault.setdefault(key, step)
            elif mark == CycleMark.FIRST_STEP:
                first_steps[key] = step
        if mark == CycleMark.CHECKPOINT_LOADED and e.data.get("restored_from"):
            restored[key] = e.data["restored_from"]
    for e in fault_events:  # a fault names its cycle: the cycle exists and started no later than it
        key = e.data.get("cycle")
        if not key:
            continue
        marks.setdefault(key, {})
        if e.data.get("step") is not None:
            at_fault.setdefault(key, e.data["step"])
        reasons.setdefault(key, f"{e.data['fault']}: {e.data.get('message') or ''}".strip(": ")[:200])
    if not marks:
        return {}
    keys = sorted(marks)  # one lock order for concurrent writers

    def fold(c: RestartCycle) -> dict[str, Any]:
        """What this batch changes in cycle ``c`` (empty: nothing)."""
        k = c.key
        changes: dict[str, Any] = {}
        for mark, at in marks[k].items():
            if getattr(c, mark) is None or getattr(c, mark) > at:  # each mark keeps its earliest time
                changes[mark] = at
        if k in layers and c.layer == Layer.NONE:
            changes["layer"] = layers[k]
        if k in resumed:
            if c.resumed_from_step != resumed[k]:
                changes["resumed_from_step"] = resumed[k]
        elif k in first_steps and c.resumed_from_step is None:
            # Level 0/1: no checkpoint step; the first step after the restart follows it
            changes["resumed_from_step"] = max(0, first_steps[k] - 1)
        if k in restored and c.restored_from != restored[k]:
            changes["restored_from"] = restored[k]
        if k in at_fault and c.step_at_fault is None:
            changes["step_at_fault"] = at_fault[k]
        if k in reasons and c.reason == "":
            changes["reason"] = reasons[k]
        if k in commands and c.command_id != commands[k]:
            changes["command"] = commands[k]  # linked below (_link_command)
        return changes

    # Read, fold in Python, write only what moves: the thousands of batches of a job-wide restart repeat
    # the same marks, so all but a few cost one plain SELECT, take no row lock and leave the job's status
    # alone. Writers lock the rows (in key order) and fold again on what they then read.
    cycles = {c.key: c for c in RestartCycle.objects.filter(job=job, key__in=keys)}
    if len(cycles) == len(keys) and not any(fold(c) for c in cycles.values()):
        return cycles
    cycles = _locked_cycles(job, keys)
    missing = [k for k in keys if k not in cycles]
    if missing:
        estimate = freshest_step(job) if any(k not in at_fault for k in missing) else None
        RestartCycle.objects.bulk_create(
            [RestartCycle(job=job, key=k, layer=layers.get(k, Layer.NONE), step_at_fault=at_fault.get(k),
                          step_at_fault_estimate=None if k in at_fault else estimate)
             for k in missing], ignore_conflicts=True)
        cycles = _locked_cycles(job, keys)
    touched = {k: cycles[k] for k in missing}
    for k in keys:
        c = cycles[k]
        changes = fold(c)
        command = changes.pop("command", None)
        if changes:
            RestartCycle.objects.filter(pk=c.pk).update(**changes)
            for name, value in changes.items():
                setattr(c, name, value)
            touched[k] = c
        if command is not None and _link_command(job, c, command):
            cycles[k] = touched[k] = RestartCycle.objects.get(pk=c.pk)
    _cycle_status(job, touched, now)
    return cycles


def _locked_cycles(job: Job, keys: list[str]) -> dict[str, RestartCycle]:
    qs = RestartCycle.objects.select_for_update().filter(job=job, key__in=keys).order_by("key")
    return {c.key: c for c in qs}


def _link_command(job: Job, cycle: RestartCycle, command_id: int) -> bool:
    """A restart an operator asked for starts when the command was issued; delivery is its own part.
    True when the cycle row changed."""
    cmd = Command.objects.filter(job=job, pk=command_id).first()
    if cmd is None:
        return False
    qs = RestartCycle.objects.filter(pk=cycle.pk)
    n = qs.filter(command__isnull=True).update(command=cmd, delivered_at=cmd.delivered_at)
    n += qs.filter(Q(fault_at__isnull=True) | Q(fault_at__gt=cmd.issued_at)).update(fault_at=cmd.issued_at)
    n += qs.filter(reason="").update(reason=f"restart command {cmd.pk} ({cmd.level or 'job'})"[:200])
    return n > 0


def _cycle_status(job: Job, touched: dict[str, RestartCycle], now: datetime) -> None:
    """RUNNING -> RECOVERING when a cycle opens; back to RUNNING when a cycle's first step lands and no
    cycle that started later is still open. A late event of an old cycle moves nothing."""
    closed = [c for c in touched.values() if c.first_step_at is not None]
    opened = [c for c in touched.values() if c.first_step_at is None and c.start_at is not None]
    if opened:
        c = max(opened, key=lambda c: c.start_at)
        superseded = RestartCycle.objects.filter(job=job, first_step_at__gt=c.start_at).exists()
        if not superseded:
            why = f" after {c.reason}" if c.reason else ""
            set_status(job, JobStatus.RECOVERING, f"recovering: {c.title}{why}"[:500],
                       only_from=(JobStatus.RUNNING,))
    if closed:
        c = max(closed, key=lambda c: c.first_step_at)
        _close_escalated(job, c)
        still_open = RestartCycle.objects.filter(job=job, first_step_at__isnull=True).exclude(pk=c.pk).filter(
            Q(fault_at__gt=c.first_step_at) | Q(fault_at__isnull=True, detected_at__gt=c.first_step_at)
            | Q(fault_at__isnull=True, detected_at__isnull=True, aborted_at__gt=c.first_step_at)
            | Q(fault_at__isnull=True, detected_at__isnull=True, aborted_at__isnull=True,
                restarted_at__gt=c.first_step_at)).exists()
        took = f" in {c.recovery_s:.1f} s" if c.recovery_s is not None else ""
        article = "an" if c.title[0] in "aeiou" else "a"
        if not still_open and set_status(job, JobStatus.RUNNING, f"recovered by {article} {c.title}{took}",
                                         only_from=(JobStatus.RECOVERING,)):
            recovery = f" in {c.recovery_s:.1f} s" if c.recovery_s is not None else ""
            notifications.enqueue(job, Notification.Transition.RECOVERED, f"recovered:{c.key}",
                                  f"Job #{job.pk} {job.name} recovered{recovery} "
                                  f"({c.title}); training continues.", now=now)


def _close_escalated(job: Job, recovered: RestartCycle) -> None:
    """Close the cycles that were still open when ``recovered`` reached its first step and began no
    later than it did: their layer gave up (e.g. the Wrapper started on a SIGKILL, then ft_launcher
    restarted the group). Each ends at its own last mark, so it stops counting as recovery."""
    marks = ("restarted_at", "aborted_at", "detected_at", "fault_at")
    for other in RestartCycle.objects.filter(job=job, first_step_at__isnull=True).exclude(pk=recovered.pk):
        start = other.start_at
        if start is None or start > recovered.first_step_at:
            continue
        last = max((getattr(other, m) for m in marks if getattr(other, m)), default=start)
        if RestartCycle.objects.filter(pk=other.pk, first_step_at__isnull=True).update(
                first_step_at=last, escalated_to=recovered.key) and other.faults.exists():
            attribution.attribute(job, [start])  # its faults now belong to the cycle that recovered


def _apply_faults(job: Job, fault_events: list[Any], cycles: dict[str, RestartCycle]) -> None:
    rows = []
    progress = Job.last_progress_of(job.pk) if fault_events else None  # read once a batch
    for e in fault_events:
        d = e.data
        cycle = cycles.get(d.get("cycle") or "")
        rank = e.rank if e.rank is not None else (d.get("rank") if type(d.get("rank")) is int else None)
        at = hb_store.utc(e.at)
        fault_at = cycle.fault_at if cycle is not None and cycle.fault_at and cycle.fault_at < at else at
        rows.append(Fault(job=job, cycle=cycle, fault_class=d["fault"], rank=rank, node=d.get("node") or "",
                          detected_by=(d.get("detected_by") or "trainer")[:40],
                          message=redact(d.get("message") or "")[:4096], at=fault_at, detected_at=at,
                          progress_at=Fault.clip_progress(progress, fault_at),
                          source_key=f"event:{e.id}"))
    if rows:
        Fault.objects.bulk_create(rows, ignore_conflicts=True)
        attribution.attribute(job, [r.at for r in rows])


def _apply_checkpoint(job: Job, e: Any) -> None:
    """in_flight -> durable | failed | abandoned, never back; the earliest start wins.

    A save of a step again after an attempt ended (abandoned by a restart, or failed) is a new attempt
    with its own row, so the ledger keeps both and the step shows durable once the second one is. A
    trainer that names its attempts (``attempt_key``) says so itself; without one, an ``in_flight`` event
    that began after every row of the step had ended opens a new attempt keyed by its event id."""
    d = e.data
    at = hb_store.utc(e.at)
    state = d["state"]
    started = at
    if state != CheckpointState.IN_FLIGHT and d.get("write_s") is not None:
        started = hb_store.utc(e.at - float(d["write_s"]))
    attempt_key = d.get("attempt_key") or _unnamed_attempt(job, d["step"], e.id, started,
                                                           opens=state == CheckpointState.IN_FLIGHT)
    key = {"job": job, "step": d["step"], "attempt_key": attempt_key}
    Checkpoint.objects.bulk_create([Checkpoint(**key, mode=d.get("mode") or CheckpointMode.ASYNC,
                                               state=CheckpointState.IN_FLIGHT, started_at=started)],
                                   ignore_conflicts=True)
    qs = Checkpoint.objects.filter(**key)
    qs.filter(started_at__gt=started).update(started_at=started)
    if state in _FINAL_CKPT:
        fields: dict[str, Any] = {"state": state, "finished_at": at}
        for k in ("blocking_s", "write_s", "bytes", "interference_s"):
            if d.get(k) is not None:
                fields[k] = d[k]
        if d.get("mode"):
            fields["mode"] = d["mode"]
        qs.filter(state=CheckpointState.IN_FLIGHT).update(**fields)


def _unnamed_attempt(job: Job, step: int, event_id: str, started: datetime, *, opens: bool) -> str:
    """The attempt an event without ``attempt_key`` belongs to: the step's open row if there is one;
    a new attempt for a save that ``opens`` after the step's last attempt ended; else the newest row
    (a late state of an attempt that ended changes nothing)."""
    rows = list(Checkpoint.objects.filter(job=job, step=step).order_by("-started_at", "-id")
                .values_list("attempt_key", "state", "finished_at"))
    if not rows:
        return ""
    for key, state, _ in rows:
        if state == CheckpointState.IN_FLIGHT:
            return key
    ended = max((f for _, _, f in rows if f is not None), default=None)
    if opens and ended is not None and started >= ended:
        return f"event:{event_id}"[:64]
    return rows[0][0]


# --- commands down ---------------------------------------------------------------------------------------


def pending_commands(job_id: int, *, now: datetime) -> list[dict]:
    """The job's trainer-bound commands not yet acknowledged, oldest first; marks first deliveries."""
    cmds = list(Command.objects.filter(job_id=job_id, via_trainer=True, status__in=_OPEN_COMMANDS)
                .order_by("issued_at", "id"))
    fresh = [c.pk for c in cmds if c.status == CommandStatus.PENDING]
    if fresh:
        Command.objects.filter(pk__in=fresh, status=CommandStatus.PENDING).update(
            status=CommandStatus.DELIVERED, delivered_at=now)
    return [c.to_wire() for c in cmds]
