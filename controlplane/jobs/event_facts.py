"""Facts derived from newly stored events (``jobs.ingestion`` calls ``apply_events`` with the rows its
insert returned, so a retried event derives nothing twice): restart cycles (``jobs.restart_cycles``),
faults, checkpoint attempts and command acks.

Every derived fact is monotone, so out-of-order arrival does not matter: cycle marks keep the earliest
timestamp, checkpoint states only leave ``in_flight``, command acks only leave pending/delivered.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from controlplane.jobs import attribution
from controlplane.jobs.models import Checkpoint, Command, CommandStatus, Fault, Job, RestartCycle
from controlplane.jobs.rank_rows import utc
from controlplane.jobs.restart_cycles import apply_cycles
from trainer.wire import CheckpointMode, CheckpointState, EventKind, redact

_FINAL_CKPT = (CheckpointState.DURABLE, CheckpointState.FAILED, CheckpointState.ABANDONED)
OPEN_COMMANDS = (CommandStatus.PENDING, CommandStatus.DELIVERED)


def apply_events(job: Job, events: list[Any], *, now: datetime) -> None:
    """Derive cycles, faults, checkpoints and command acks from newly stored events (in timestamp order)."""
    events = sorted(events, key=lambda e: e.at)
    by_kind: dict[str, list[Any]] = {}
    for e in events:
        by_kind.setdefault(e.kind, []).append(e)
    cycles = apply_cycles(job, by_kind.get(EventKind.CYCLE, []), by_kind.get(EventKind.FAULT, []), now)
    _apply_faults(job, by_kind.get(EventKind.FAULT, []), cycles)
    for e in by_kind.get(EventKind.CHECKPOINT, []):
        _apply_checkpoint(job, e)
    for e in by_kind.get(EventKind.COMMAND_ACK, []):
        d = e.data
        Command.objects.filter(job=job, pk=d["command_id"], status__in=OPEN_COMMANDS).update(
            status=CommandStatus.ACKED if d["ok"] else CommandStatus.FAILED, acked_at=utc(e.at),
            detail=str(d.get("detail") or "")[:2000])


def _apply_faults(job: Job, fault_events: list[Any], cycles: dict[str, RestartCycle]) -> None:
    rows = []
    progress = Job.last_progress_of(job.pk) if fault_events else None  # read once a batch
    for e in fault_events:
        d = e.data
        cycle = cycles.get(d.get("cycle") or "")
        rank = e.rank if e.rank is not None else (d.get("rank") if type(d.get("rank")) is int else None)
        at = utc(e.at)
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
    at = utc(e.at)
    state = d["state"]
    started = at
    if state != CheckpointState.IN_FLIGHT and d.get("write_s") is not None:
        started = utc(e.at - float(d["write_s"]))
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
