"""Launcher workflows: start an attempt, stop, job-level restart, and follow what the launcher sees.

Policy lives here, not in the backends: a launcher reports ``PollResult``s; this module decides
whether a failure becomes a job-level restart (new processes or pods) or ends the job.
Every state change is a conditional update, so two workers running ``supervise_job`` at once
act once.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from controlplane.jobs import attribution, policy
from controlplane.jobs.launcher_port import TRAINER_STOP_GRACE_S
from controlplane.jobs.models import (
    ACTIVE_STATUSES,
    Command,
    CommandStatus,
    Fault,
    Job,
    JobStatus,
    RestartCycle,
)
from controlplane.jobs.services import begin_job_restart, finish_command, set_status
from controlplane.launchers.backends import get_launcher
from controlplane.launchers.base import LaunchError, LaunchFault, PollResult, TransientLaunchError
from trainer.policy_rules import Action, Decision
from trainer.wire import CommandKind, Layer, cycle_key

log = logging.getLogger(__name__)
STOP_GRACE_S = 10.0
# A launch or relaunch that has not produced a running attempt after this long is failed.
LAUNCH_TIMEOUT = timedelta(minutes=10)
# Pods that cannot start (unschedulable, image pull) fail the job after this long.
PENDING_TIMEOUT = timedelta(minutes=10)
# A job-level relaunch that failed transiently is tried again after this long.
RELAUNCH_RETRY_AFTER = timedelta(seconds=30)
# A stop whose task has not carried it out this long after it was due is carried out by the supervise pass.
STOP_BACKSTOP_AFTER = timedelta(seconds=30)


def preflight(*, spec) -> list[str]:
    """What would make launching this spec fail, as messages for the form or the API; empty when fine."""
    try:
        return get_launcher(spec.backend).preflight(Job(spec=spec.to_dict(), backend=spec.backend))
    except (LaunchError, TransientLaunchError) as e:
        return [str(e)]


def start_attempt(*, job: Job) -> None:
    """Launch ``job.attempt`` with a freshly minted ingest token.

    Minting on every attempt means a launch retried after a transient error always has the
    plaintext to hand over (only the hash is stored), and a stopped attempt's token stops working.
    """
    launcher = get_launcher(job.backend)
    token = job.issue_token()
    Job.objects.filter(pk=job.pk).update(token_hash=job.token_hash)
    try:
        state = launcher.launch(job, token=token)
    except LaunchError as e:
        set_status(job, JobStatus.FAILED, f"launch failed: {e}")
        raise
    now = timezone.now()
    Job.objects.filter(pk=job.pk).update(launcher_state=state, started_at=job.started_at or now)
    job.launcher_state = state
    cycle = RestartCycle.objects.filter(job=job, key=cycle_key(attempt=job.attempt)).first()
    if cycle is not None and cycle.restarted_at is None:
        RestartCycle.objects.filter(pk=cycle.pk).update(restarted_at=now)
    log.info("job %s attempt %s launched (%s)", job.pk, job.attempt, job.backend)


def launch_job_now(*, job_id: int) -> None:
    job = Job.objects.get(pk=job_id)
    if job.status not in (JobStatus.PENDING, JobStatus.LAUNCHING) or job.launcher_state:
        return  # already launched (a retried task) or stopped meanwhile
    start_attempt(job=job)


def stop_job_now(*, job_id: int, command_id: int | None, reason: str = "stopped by an operator") -> None:
    """End whatever is left of the job (after the trainer's graceful stop had its grace period).

    The job is marked stopped first, so a supervisor that sees the processes die meanwhile does
    not take it for a failure and relaunch; an attempt that a racing relaunch started anyway is
    stopped too.
    """
    job = Job.objects.get(pk=job_id)
    if job.status in ACTIVE_STATUSES:
        set_status(job, JobStatus.STOPPED, reason)
    launcher = get_launcher(job.backend)
    for _ in range(3):
        launcher.stop(job, grace_s=STOP_GRACE_S)
        stopped_attempt = job.attempt
        job.refresh_from_db()
        if job.attempt == stopped_attempt:
            Job.revoke_token(job.pk, stopped_attempt)
            break
    if (job.launcher_state or {}).get("held"):
        Job.objects.filter(pk=job.pk).update(launcher_state={k: v for k, v in job.launcher_state.items()
                                                             if k != "held"})
    if command_id is not None:
        finish_command(command_id=command_id, detail="processes stopped by the launcher")


def hold_job_now(*, job_id: int) -> None:
    """A failure policy's ``stop_keep``: the job has failed; keep its processes or pods for debugging
    (``Launcher.hold``) and say so on the job (``launcher_state["held"]``) until a Stop releases them."""
    job = Job.objects.get(pk=job_id)
    if job.is_active or job.commands.filter(kind=CommandKind.STOP).exists():
        return  # relaunched or stopped meanwhile: nothing to keep
    kept = get_launcher(job.backend).hold(job)
    Job.objects.filter(pk=job.pk).update(launcher_state={**(job.launcher_state or {}), "held": kept})
    log.warning("job %s: kept for debugging: %s", job.pk, kept)


def restart_job_now(*, job_id: int, command_id: int | None, reason: str = "restart requested by an operator",
                    fault_at: datetime | None = None, expected_attempt: int | None = None) -> bool:
    """Job-level restart: stop every process or pod, then start attempt N+1 from the last durable checkpoint.

    1. Open the cycle ``job<N+1>`` (get-or-create: a retried task reuses it).
    2. Stop attempt N (idempotent).
    3. Claim attempt N+1 with a conditional UPDATE on ``attempt``; 0 rows = another worker did it.
    4. Launch; the trainer reports the cycle's reload and first step.
    """
    job = Job.objects.get(pk=job_id)
    if expected_attempt is not None and job.attempt != expected_attempt:
        return False
    cycle = begin_job_restart(job=job, reason=reason, fault_at=fault_at)
    get_launcher(job.backend).stop(job, grace_s=STOP_GRACE_S)
    Job.revoke_token(job.pk, job.attempt)  # the next attempt gets its own (start_attempt)
    RestartCycle.objects.filter(pk=cycle.pk, aborted_at__isnull=True).update(aborted_at=timezone.now())
    claimed = Job.objects.filter(pk=job.pk, attempt=job.attempt).update(attempt=job.attempt + 1, launcher_state={})
    if not claimed:
        return False
    job.attempt += 1
    job.launcher_state = {}
    if job.commands.filter(kind=CommandKind.STOP).exists():
        return False  # a stop arrived while the old attempt was being torn down
    start_attempt(job=job)
    if command_id is not None:
        finish_command(command_id=command_id, detail=f"relaunched as attempt {job.attempt}")
    return True


def record_launch_fault(job: Job, fault: LaunchFault, *, decided: bool = False) -> bool:
    """Store a fault only the launcher saw, once per occurrence. True when it is new. ``decided``: the caller
    takes the failure policy's decision for it (the end of an attempt), so the watchdog's pass does not."""
    at = datetime.fromtimestamp(fault.at, tz=UTC) if fault.at else timezone.now()
    try:
        with transaction.atomic():
            Fault.objects.create(job=job, fault_class=fault.fault_class, rank=fault.rank, node=fault.node,
                                 detected_by="launcher", message=fault.message[:2000], at=at,
                                 progress_at=Fault.progress_before(job.pk, at),
                                 source_key=f"{job.backend}:{fault.source_key}"[:100],
                                 policy_at=timezone.now() if decided else None)
    except IntegrityError:
        return False
    attribution.attribute(job, [at])
    return True


def supervise_job(*, job: Job) -> str:
    """Poll the launcher once and act on what it sees. Returns the poll state."""
    result = get_launcher(job.backend).poll(job)
    stopping = result.state in ("succeeded", "failed", "lost") and job.commands.filter(kind=CommandKind.STOP).exists()
    for fault in result.faults if not stopping else ():
        record_launch_fault(job, fault, decided=result.state in ("failed", "lost"))
    if stopping:
        # An operator asked for a stop: however the processes ended, that is what happened.
        set_status(job, JobStatus.STOPPED, "stopped by an operator", only_from=ACTIVE_STATUSES)
    elif result.state == "succeeded":
        set_status(job, JobStatus.SUCCEEDED, result.reason, only_from=ACTIVE_STATUSES)
    elif result.state == "pending" and result.faults and timezone.now() - job.status_changed_at > PENDING_TIMEOUT:
        if set_status(job, JobStatus.FAILED, f"could not start within {PENDING_TIMEOUT}: "
                      f"{result.faults[-1].message}", only_from=ACTIVE_STATUSES):
            get_launcher(job.backend).stop(job, grace_s=STOP_GRACE_S)
            Job.revoke_token(job.pk, job.attempt)
    elif result.state in ("failed", "lost"):
        _end_of_attempt(job, result)
    if result.state in ("succeeded", "failed", "lost"):
        # The attempt's processes are gone: its token goes with them (conditional on the attempt, so a
        # relaunch above, with its new attempt and token, is untouched).
        Job.revoke_token(job.pk, job.attempt)
    return result.state


def _end_of_attempt(job: Job, result: PollResult) -> None:
    """The attempt's processes or pods ended with a failure: the failure policy decides (a written rule on
    its faults, else the default: relaunch while job-level restarts are left and a relaunch can help, else
    fail the job). The decision is a ``policy`` event on the timeline."""
    spec = job.job_spec
    policy.apply_job_policies(job)  # the ranks' own faults first: their rules may have stopped or restarted it
    if not job.is_active or job.commands.filter(kind=CommandKind.RESTART, level=Layer.JOB).exclude(
            status__in=(CommandStatus.DONE, CommandStatus.FAILED)).exists():
        return
    decision = policy.decide_launch(job, [(f.fault_class, f.message) for f in result.faults], spec)
    can_restart = result.retryable and spec.job_restart and job.attempt < spec.max_job_restarts
    if decision is None or decision.action not in (Action.STOP, Action.STOP_KEEP, Action.RESTART_JOB,
                                                   Action.NOTIFY):
        why = (f"default: job_restart on, {spec.max_job_restarts - job.attempt} left" if can_restart else
               "default: " + ("a relaunch would fail the same way" if not result.retryable else
                              "job-level restarts are off or used up"))
        decision = Decision(Action.RESTART_JOB if can_restart else Action.STOP, None, why)
    key = f"a{job.attempt}-end"
    subject = f"attempt {job.attempt} ended ({result.reason})"[:300]
    with transaction.atomic():
        policy.record(job, decision, key=key, subject=subject, rank=None, now=timezone.now())
        if decision.written and decision.action != Action.RESTART_JOB:
            policy.carry_out(job, decision, key=key, subject=subject)
    if decision.action in (Action.STOP, Action.STOP_KEEP) and decision.written:
        return
    if decision.action in (Action.RESTART_JOB, Action.NOTIFY) and can_restart:
        fault_at = None
        if result.faults and result.faults[0].at:
            fault_at = datetime.fromtimestamp(result.faults[0].at, tz=UTC)
        restart_job_now(job_id=job.pk, command_id=None, reason=f"job-level restart: {result.reason}",
                        fault_at=fault_at, expected_attempt=job.attempt)
    else:
        why = result.reason
        if spec.job_restart and result.retryable and job.attempt >= spec.max_job_restarts:
            why += f" (job-level restarts used up: {job.attempt} of {spec.max_job_restarts})"
        set_status(job, JobStatus.FAILED, why, only_from=ACTIVE_STATUSES)


def retry_stuck_launches(now: datetime | None = None) -> int:
    """Jobs without a running attempt: relaunch a job-level restart whose launch failed transiently,
    fail what has waited past LAUNCH_TIMEOUT. Each retry is claimed with a conditional update."""
    now = now or timezone.now()
    n = 0
    for job in Job.objects.active().filter(launcher_state={}):
        waited = now - job.status_changed_at
        if waited > LAUNCH_TIMEOUT:
            set_status(job, JobStatus.FAILED, f"the launcher could not start attempt {job.attempt} "
                       f"within {LAUNCH_TIMEOUT}; see the worker log", only_from=ACTIVE_STATUSES)
        elif job.status == JobStatus.RECOVERING and job.attempt > 0 and waited > RELAUNCH_RETRY_AFTER:
            claimed = Job.objects.filter(pk=job.pk, launcher_state={}, status_changed_at=job.status_changed_at
                                         ).update(status_changed_at=now)
            if claimed:
                job.status_changed_at = now
                try:
                    start_attempt(job=job)
                except (LaunchError, TransientLaunchError) as e:
                    log.warning("relaunch of job %s attempt %s failed: %s", job.pk, job.attempt, e)
                n += 1
    return n


def carry_out_stops(now: datetime | None = None) -> int:
    """Stops whose task never ran (the broker was down, a worker died with it): the stop command is the
    outbox row. A control-plane stop (a restart storm) is due at once; an operator's stop after the
    trainer's grace period, and only while the job is still active. Stopping is idempotent, so a pass
    that races the task does no harm. Returns how many stops it carried out."""
    now = now or timezone.now()
    trainer_due = now - STOP_BACKSTOP_AFTER - timedelta(seconds=TRAINER_STOP_GRACE_S)
    overdue = (Command.objects.filter(kind=CommandKind.STOP)
               .exclude(status__in=(CommandStatus.DONE, CommandStatus.FAILED))
               .filter(Q(via_trainer=False, issued_at__lte=now - STOP_BACKSTOP_AFTER)
                       | Q(via_trainer=True, job__status__in=ACTIVE_STATUSES, issued_at__lte=trainer_due)))
    n = 0
    for cmd in overdue.only("pk", "job_id"):
        log.warning("job %s: stop command %s was not carried out by its task; stopping now",
                    cmd.job_id, cmd.pk)
        try:
            stop_job_now(job_id=cmd.job_id, command_id=cmd.pk)
        except Exception:  # one broken job must not stop the others' stops
            log.exception("stopping job %s failed", cmd.job_id)
            continue
        n += 1
    return n


def supervise_all() -> int:
    """One pass over every active job, then overdue stops and stuck launches. Safe to run in several
    workers at once."""
    n = 0
    for job in Job.objects.active().exclude(launcher_state={}):
        try:
            supervise_job(job=job)
        except Exception:  # one broken job must not stop supervision of the others
            log.exception("supervising job %s failed", job.pk)
        n += 1
    carry_out_stops()
    retry_stuck_launches()
    return n
