"""Workflows that cross a boundary: create, launch, stop, restart, inject. Keyword-only arguments.

Every operator action writes an AuditEntry in the same transaction as its Command, so an action
is never carried out without its audit line, nor audited without being carried out.
"""

from __future__ import annotations

import logging

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.utils import timezone

from controlplane.jobs import heartbeats as hb_store
from controlplane.jobs import launcher_port, readouts
from controlplane.jobs.models import (
    AuditEntry,
    Command,
    CommandStatus,
    Job,
    JobStatus,
    RestartCycle,
)
from controlplane.jobs.spec import JobSpec
from trainer.wire import CommandKind, DrillFault, Layer, cycle_key

log = logging.getLogger(__name__)


class ActionError(ValueError):
    """An operator action that cannot be carried out now; the message says why."""


def record_audit(*, actor: AbstractBaseUser | None, action: str, job: Job | None = None,
                 detail: dict | None = None, remote_addr: str | None = None) -> AuditEntry:
    return AuditEntry.objects.create(
        actor=actor if actor is not None and actor.is_authenticated else None,
        actor_name=actor.get_username() if actor is not None and actor.is_authenticated else "system",
        action=action, job=job, detail=detail or {}, remote_addr=remote_addr,
    )


def set_status(job: Job, status: str, reason: str = "", *, only_from: tuple[str, ...] | None = None) -> bool:
    """Move a job to ``status`` with a conditional UPDATE (0 rows = someone else moved it first)."""
    now = timezone.now()
    qs = Job.objects.filter(pk=job.pk)
    if only_from is not None:
        qs = qs.filter(status__in=only_from)
    fields = {"status": status, "status_reason": reason[:500], "status_changed_at": now}
    if status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
        fields["finished_at"] = now
    changed = qs.exclude(status=status).update(**fields) == 1
    if changed:  # the conditional UPDATE makes this the one writer of the change: it logs it, once
        log.info("job %s %s%s", job.pk, status, f": {reason}" if reason else "")
        for k, v in fields.items():
            setattr(job, k, v)
    return changed


def create_job(*, name: str, spec: JobSpec, created_by: AbstractBaseUser | None,
               notify_webhook_url: str = "", notify_email: str = "", remote_addr: str | None = None,
               launch: bool = True) -> Job:
    """Store a new job and (by default) enqueue its launch once the transaction commits."""
    with transaction.atomic():
        job = Job(name=name, spec=spec.to_dict(), backend=spec.backend, created_by=created_by,
                  notify_webhook_url=notify_webhook_url, notify_email=notify_email)
        job.save()
        _forget_stale_heartbeats(job.pk)
        record_audit(actor=created_by, action="job.create", job=job,
                     detail={"name": name, "spec": spec.to_dict()}, remote_addr=remote_addr)
        if launch:
            _enqueue_launch(job)
    return job


def _forget_stale_heartbeats(job_id: int) -> None:
    """A new job's id may have been used before in the heartbeat store (the database was reset or restored
    while Redis kept its keys): state under that id belongs to another job and would, for one, hold a
    ``max_step`` the new job has not reached, so the restart-storm rule would see no progress. Nothing
    can have beaten for this job yet (its ingest token is not committed)."""
    try:
        hb_store.get_store().drop_job(job_id)
    except Exception:  # Redis down: the job is still created; the outage rules cover beats
        log.warning("job %s: could not clear stale heartbeat state for its id", job_id, exc_info=True)


def _enqueue_launch(job: Job) -> None:
    set_status(job, JobStatus.LAUNCHING, "waiting for the launcher")
    launcher_port.request("launch", job_id=job.pk)


def _trainer_command(*, job: Job, kind: str, actor, remote_addr, level: str = "", fault: str = "",
                     rank: int | None = None) -> Command:
    if not job.is_active:
        raise ActionError(f"job #{job.pk} is {job.status}; only a running job takes commands")
    if rank is not None and not 0 <= rank < job.world_size:
        raise ActionError(f"rank {rank} is not in this job (ranks 0..{job.world_size - 1})")
    with transaction.atomic():
        cmd = Command.objects.create(job=job, kind=kind, level=level, fault=fault, rank=rank,
                                     issued_by=actor if actor and actor.is_authenticated else None)
        record_audit(actor=actor, action=f"job.{kind}", job=job, remote_addr=remote_addr,
                     detail={"command": cmd.pk, "level": level, "fault": fault, "rank": rank})
    return cmd


def restart_job(*, job: Job, level: str, requested_by, rank: int | None = None,
                remote_addr: str | None = None) -> Command:
    """Restart at a layer. In-process and in-job go to the trainer; job-level goes to the launcher."""
    spec = job.job_spec
    if level == Layer.IN_PROCESS and not spec.in_process:
        raise ActionError("in-process restart is off for this job; restart in-job or the whole job")
    if level == Layer.IN_JOB and not spec.in_job:
        raise ActionError("in-job restart (ft_launcher) is off for this job; restart the whole job")
    if level in (Layer.IN_PROCESS, Layer.IN_JOB):
        return _trainer_command(job=job, kind=CommandKind.RESTART, level=level, rank=rank,
                                actor=requested_by, remote_addr=remote_addr)
    if level != Layer.JOB:
        raise ActionError(f"unknown restart level {level!r}: use in_process, in_job or job")

    with transaction.atomic():
        job = Job.objects.select_for_update().get(pk=job.pk)
        if job.status not in (JobStatus.RUNNING, JobStatus.RECOVERING, JobStatus.LAUNCHING):
            raise ActionError(f"job #{job.pk} is {job.status}; only a running job can be restarted")
        cmd = Command.objects.create(job=job, kind=CommandKind.RESTART, level=Layer.JOB, via_trainer=False,
                                     issued_by=requested_by if requested_by and requested_by.is_authenticated else None)
        record_audit(actor=requested_by, action="job.restart", job=job, remote_addr=remote_addr,
                     detail={"command": cmd.pk, "level": Layer.JOB})
        launcher_port.request("restart", job_id=job.pk, command_id=cmd.pk)
    return cmd


def inject_fault(*, job: Job, fault: str, rank: int, requested_by, remote_addr: str | None = None) -> Command:
    if fault not in DrillFault.__members__.values():
        raise ActionError(f"unknown fault {fault!r}: use one of {', '.join(f.value for f in DrillFault)}")
    return _trainer_command(job=job, kind=CommandKind.INJECT_FAULT, fault=fault, rank=rank,
                            actor=requested_by, remote_addr=remote_addr)


def stop_grace_s(job: Job) -> float:
    """How long the trainer has to stop by itself before the launcher ends what is left: none when the
    job's code reported Level 0 only (an unmodified script cannot see a stop command, so waiting would
    only delay the stop), else ``TRAINER_STOP_GRACE_S``."""
    integration = readouts.integration(job)
    if integration is not None and integration.level == 0:
        return 0.0
    return launcher_port.TRAINER_STOP_GRACE_S


def stop_job(*, job: Job, requested_by, remote_addr: str | None = None, grace_s: float | None = None) -> Command:
    """Graceful stop: the trainer saves a final checkpoint and exits; the launcher ends what is left
    after ``grace_s`` (default: ``stop_grace_s(job)``). A failed job whose processes or pods a failure
    policy kept for debugging (``launcher_state["held"]``) is released at once."""
    if not job.is_active and (job.launcher_state or {}).get("held"):
        with transaction.atomic():
            cmd = Command.objects.create(job=job, kind=CommandKind.STOP, via_trainer=False,
                                         issued_by=requested_by if requested_by and requested_by.is_authenticated
                                         else None, detail="release the processes kept for debugging")
            record_audit(actor=requested_by, action="job.stop", job=job, remote_addr=remote_addr,
                         detail={"command": cmd.pk, "released": True})
            launcher_port.request("stop", job_id=job.pk, command_id=cmd.pk)
        return cmd
    if not job.is_active:
        raise ActionError(f"job #{job.pk} is already {job.status}")
    if grace_s is None:
        grace_s = stop_grace_s(job)
    cmd = _trainer_command(job=job, kind=CommandKind.STOP, actor=requested_by, remote_addr=remote_addr)
    launcher_port.request("stop", job_id=job.pk, command_id=cmd.pk, countdown=grace_s)
    return cmd


def request_stop(job_id: int, *, reason: str) -> None:
    """Ask the launcher to end the job's processes: a stop command row (its outbox, carried out even if the
    nudge is lost) written in the caller's transaction, and a nudge once it commits."""
    cmd = Command.objects.create(job_id=job_id, kind=CommandKind.STOP, via_trainer=False,
                                 detail=reason[:2000])
    launcher_port.request("stop", job_id=job_id, command_id=cmd.pk)


def freshest_step(job: Job) -> int:
    """An older trainer's fault without a step: the freshest step the control plane knows. The
    database store's rows are current; with Redis, its progress hash is fresh to the last batch (the
    job's rows lag a flush), but holds the highest step reached, so right after a rollback, until the
    job passes it again, this reads high. The trainer's own step has neither error."""
    step = job.last_step
    store = hb_store.get_store()
    if isinstance(store, hb_store.RedisHeartbeatStore):
        try:
            top, _ = store.progress(job.pk)
        except Exception:  # noqa: BLE001 - Redis away: the row's step is the best left
            top = None
        if top is not None:
            step = max(step, top[0])
    return step


def begin_job_restart(*, job: Job, reason: str, fault_at=None) -> RestartCycle:
    """Open the restart cycle of a job-level restart (new processes or pods) before stopping the old ones."""
    now = timezone.now()
    key = cycle_key(attempt=job.attempt + 1)
    cycle, _ = RestartCycle.objects.get_or_create(
        job=job, key=key,
        defaults={"layer": Layer.JOB, "reason": reason[:200], "fault_at": fault_at or now, "detected_at": now,
                  "step_at_fault_estimate": freshest_step(job)},
    )
    set_status(job, JobStatus.RECOVERING, reason)
    return cycle


def finish_command(*, command_id: int, detail: str) -> None:
    """Mark a command carried out by the control plane (stop, job-level restart) as done, unless the
    trainer already acknowledged it. One conditional UPDATE; a missing command is ignored."""
    Command.objects.filter(pk=command_id).exclude(status__in=(CommandStatus.ACKED, CommandStatus.DONE)).update(
        status=CommandStatus.DONE, detail=detail[:2000], acked_at=timezone.now())
