"""Failure policies on the control plane: decide each fault it records, carry out what a written rule says,
and tell the job page what the next fault of each class would cause.

The rules and the decision are ``trainer.policy_rules``'s (pure; ft_launcher's hooks read the same rules). This
module supplies the history a decision needs (how many faults each rule has matched in its window, what
each restart layer has left) and acts:

- ``apply_policies`` (a watchdog check) claims every undecided fault of an active job with a conditional
  UPDATE of ``Fault.policy_at``, decides it and records the decision as a ``policy`` event on the timeline
  (the rule that fired, or the default). Only a written rule makes the control plane act: stop for good,
  stop and keep the processes or pods for debugging, restart the whole job, restart in-job (a command to
  the trainer), notify. A default decision is the layers' own, recorded, never repeated here.
- ``launchers.services.supervise_job`` decides a failed attempt's faults itself (``decide_launch``), as
  the one place that restarts or fails a job whose processes ended.

Accepted trade-offs: a fault the trainer catches (exception, NaN loss, hang) was already retried by its
own layer when the control plane hears of it, so a rule's action follows that first retry (a rule
``nan_loss: restart_in_job`` restarts the worker group right after the in-process restart began). A
rule counting faults "without progress" counts those since the job's last progress as of the fault
(``Fault.progress_at``, kept when it is recorded), so the recovery that follows a fault cannot take it
out of its own count however late the decision runs; the progress it reads lags the Redis heartbeat
store by up to one flush.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from django.db import transaction
from django.db.models import F, Q
from django.db.models.functions import Coalesce
from django.utils import timezone

from controlplane.jobs import evidence, launcher_port, notifications
from controlplane.jobs.models import (
    ACTIVE_STATUSES,
    LAYER_WORDS,
    Command,
    CommandStatus,
    Event,
    Fault,
    Job,
    JobStatus,
    Notification,
    RestartCycle,
)
from controlplane.jobs.services import request_stop, set_status
from controlplane.jobs.spec import JobSpec
from trainer.policy_rules import (
    ACTION_WORDS,
    POD_CLASSES,
    START_CLASSES,
    STRAGGLER,
    Action,
    Budget,
    Decision,
    Facts,
    Rule,
    decide,
)
from trainer.wire import CommandKind, FaultClass, Layer

log = logging.getLogger(__name__)

POLICY_EVENT = "policy"  # an Event kind the control plane writes (source "policy")
HISTORY = 500  # faults a rule's count reads back, newest first
LAYER_ACTION = {Layer.IN_PROCESS: Action.RETRY_IN_PROCESS, Layer.IN_JOB: Action.RESTART_IN_JOB,
                Layer.JOB: Action.RESTART_JOB}
_EXIT_SAID = re.compile(r"\bexit(?:ed with)?(?: code| status) (-?\d+)\b")
_SIGNAL = re.compile(r"\b(SIG[A-Z0-9]+)\b")


# -- history ------------------------------------------------------------------------------------------


def facts_of(f: Fault, *, kill: bool = True) -> Facts:
    """A stored fault's facts (``kill``: also its exit code and signal, which may read its event)."""
    sig, code = evidence.kill_facts(f, evidence.fault_data(f), from_message=True) if kill else (None, None)
    return Facts(fault_class=f.fault_class, exit_code=code, signal=sig, text=f.message or "")


def launch_facts(fault_class: str, message: str) -> Facts:
    """Facts of a fault only the launcher saw (its message words the exit code and signal)."""
    code, sig = _EXIT_SAID.search(message), _SIGNAL.search(message)
    return Facts(fault_class=fault_class, exit_code=int(code.group(1)) if code else None,
                 signal=sig.group(1) if sig else None, text=message)


def rule_counts(job: Job, rules: Sequence[Rule], *, until: datetime, since: datetime | None) -> list[int]:
    """Faults of ``job`` up to ``until`` that each rule matches, in its window: since ``since`` (the
    job's last step progress before the fault being decided, ``Fault.progress_at``; for the next fault,
    ``Job.last_progress_at``; None: none yet), or all."""
    if not rules:
        return []
    # A consequence (a peer's gloo error after a rank was killed: ``jobs.attribution``) is not a failure of
    # its own; a repeat is (the same failure again is what a count is for).
    qs = Fault.objects.filter(job=job, at__lte=until).exclude(link="consequence").order_by("-at", "-id")
    if since is not None and all(r.without_progress for r in rules):
        qs = qs.filter(at__gte=since)
    kill = any(r.match.exit_code is not None or r.match.signal is not None for r in rules)
    history = [(f.at, facts_of(f, kill=kill)) for f in qs[:HISTORY]]
    return [sum(1 for at, fa in history if r.match.matches(fa)
                and (not r.without_progress or since is None or at >= since)) for r in rules]


def storm_cycles():
    """Restart cycles started since their job last made step progress (the restart-storm rule counts these)."""
    start = Coalesce("fault_at", "detected_at", "aborted_at", "restarted_at", "checkpoint_loaded_at",
                     "first_step_at")
    return (RestartCycle.objects.annotate(start=start).filter(start__isnull=False)
            .filter(Q(job__last_progress_at__isnull=True) | Q(start__gt=F("job__last_progress_at"))))


_ROUND = re.compile(r"^a(\d+)-ij(\d+)(?:-ip(\d+))?$")


def budget(job: Job, spec: JobSpec) -> Budget:
    """What each restart layer has left now. In-job rounds and in-process iterations count in the current
    attempt's cycle keys (``wire.cycle_key``); the in-process Wrapper's count restarts with each round."""
    rounds: dict[int, int] = {}
    for key in RestartCycle.objects.filter(job=job, key__startswith=f"a{job.attempt}-ij").values_list("key",
                                                                                                      flat=True):
        m = _ROUND.match(key)
        if m:
            n = int(m[2])
            rounds[n] = rounds.get(n, 0) + (1 if m[3] is not None else 0)
    current = max(rounds, default=0)
    storms = storm_cycles().filter(job=job).count()
    return Budget(in_process=spec.in_process, in_job=spec.in_job, job_restart=spec.job_restart,
                  in_process_left=spec.max_in_process_restarts - rounds.get(current, 0),
                  in_job_left=spec.max_in_job_restarts - current,
                  job_left=spec.max_job_restarts - job.attempt,
                  storm_left=spec.storm_restarts - storms - 1)


# -- decisions ----------------------------------------------------------------------------------------


def decide_fault(job: Job, f: Fault, spec: JobSpec | None = None) -> Decision:
    """The decision for a recorded fault: a written rule that fired, else the layer that took it (its
    cycle's), else what the layers would do now."""
    spec = spec or job.job_spec
    rules = spec.failure_policy
    kill = any(r.match.exit_code is not None or r.match.signal is not None for r in rules)
    facts = facts_of(f, kill=kill) if rules else Facts(fault_class=f.fault_class)
    d = decide(rules, facts, rule_counts(job, rules, until=f.at, since=f.progress_at), budget(job, spec))
    if d.written or f.cycle is None or f.cycle.layer not in LAYER_ACTION:
        return d
    return Decision(LAYER_ACTION[Layer(f.cycle.layer)], None,
                    f"default: the {LAYER_WORDS[f.cycle.layer]} layer took it")


def decide_launch(job: Job, faults: Sequence[tuple[str, str]], spec: JobSpec) -> Decision | None:
    """A written rule's decision for a failed attempt from its launcher faults ((class, message), already
    stored): the first fault a rule fires on. None: the launcher's default (relaunch while job-level
    restarts are left, else fail)."""
    rules = spec.failure_policy
    if not rules:
        return None
    counts = rule_counts(job, rules, until=timezone.now(), since=job.last_progress_at)
    b = budget(job, spec)
    for cls, message in faults:
        d = decide(rules, launch_facts(cls, message), counts, b)
        if d.written:
            return d
    return None


@dataclass(frozen=True, slots=True)
class NextRow:
    label: str  # the fault, in words
    action: str
    words: str  # the action in words
    why: str
    written: bool


def what_next(job: Job, now: datetime | None = None) -> list[NextRow]:
    """For the job's current state: what the next fault of each class (and of each written rule's exit
    code, signal or reason) would cause. The job page's table; one decision function with the faults'."""
    now = now or timezone.now()
    spec = job.job_spec
    rules = spec.failure_policy
    counts = rule_counts(job, rules, until=now, since=job.last_progress_at)
    b = budget(job, spec)
    classes = [c.value for c in FaultClass]
    if spec.backend != "kubernetes":
        classes = [c for c in classes if c not in POD_CLASSES | START_CLASSES]
    cases = [(c, Facts(fault_class=c)) for c in (*classes, STRAGGLER)]
    for r in rules:
        m = r.match
        if m.exit_code is not None or m.signal or m.reason:
            cls = m.fault_class or (FaultClass.OOM_KILLED if m.reason == "OOMKilled"
                                    else FaultClass.PROCESS_KILLED)
            cases.append((m.words(), Facts(fault_class=cls, exit_code=m.exit_code, signal=m.signal,
                                           text=m.reason or "")))
    rows = []
    for label, facts in cases:
        nxt = [n + 1 if r.match.matches(facts) else n for r, n in zip(rules, counts, strict=True)]
        d = decide(rules, facts, nxt, b)
        rows.append(NextRow(label=label, action=d.action, words=ACTION_WORDS[Action(d.action)], why=d.why,
                            written=d.written))
    return rows


# -- acting -------------------------------------------------------------------------------------------


def record(job: Job, d: Decision, *, key: str, subject: str, rank: int | None, now: datetime,
           fault_id: int | None = None) -> None:
    """The decision as a ``policy`` event on the job's timeline (once per key)."""
    Event.objects.bulk_create([Event(
        job=job, event_id=f"policy-{key}"[:64], kind=POLICY_EVENT, rank=rank, at=now, source="policy",
        data={"subject": subject, "action": d.action, "rule": None if d.rule is None else d.rule + 1,
              "why": d.why, "fault_id": fault_id})], ignore_conflicts=True)


def carry_out(job: Job, d: Decision, *, key: str, subject: str, rank: int | None = None,
              now: datetime | None = None) -> bool:
    """Do what a written rule decided (call inside the transaction that claimed the fault). Returns True
    when the control plane acted. Defaults are the layers' own: nothing to do here."""
    if not d.written:
        return False
    now = now or timezone.now()
    reason = f"failure policy {d.why}, on {subject}"
    text = f"Job #{job.pk} {job.name}: {reason}."
    action = Action(d.action)
    if action in (Action.STOP, Action.STOP_KEEP):
        why = reason if action == Action.STOP else f"{reason}; kept for debugging (Stop releases it)"
        if not set_status(job, JobStatus.FAILED, why, only_from=ACTIVE_STATUSES):
            return False
        notifications.enqueue(job, Notification.Transition.POLICY, f"policy:{action}", text, now=now)
        if action == Action.STOP:
            request_stop(job.pk, reason=why)
        else:
            launcher_port.request("hold", job_id=job.pk)
    elif action == Action.RESTART_JOB:
        on_its_way = Command.objects.filter(job=job, kind=CommandKind.RESTART, level=Layer.JOB).exclude(
            status__in=(CommandStatus.DONE, CommandStatus.FAILED)).exists()
        if job.status not in (JobStatus.RUNNING, JobStatus.RECOVERING, JobStatus.LAUNCHING) or on_its_way:
            return False  # a job-level restart is already on its way
        cmd = Command.objects.create(job=job, kind=CommandKind.RESTART, level=Layer.JOB, via_trainer=False,
                                     detail=reason[:2000])
        launcher_port.request("restart", job_id=job.pk, command_id=cmd.pk)
    elif action == Action.RESTART_IN_JOB:
        if not job.is_active:
            return False
        Command.objects.create(job=job, kind=CommandKind.RESTART, level=Layer.IN_JOB, detail=reason[:2000])
    elif action == Action.NOTIFY:
        notifications.enqueue(job, Notification.Transition.POLICY, f"policy:{key}", text, now=now)
    else:
        return False  # retry in-process: the trainer's Wrapper already does
    log.warning("job %s: %s", job.pk, reason)
    return True


def fault_subject(f: Fault) -> str:
    return f"{f.fault_class}" + (f" on rank {f.rank}" if f.rank is not None else "")


def apply_policies(now: datetime | None = None) -> int:
    """Decide every undecided fault of an active job, oldest first; returns the number of control-plane
    actions taken.

    1. Read the undecided faults (``policy_at`` null: a partial index) of active jobs.
    2. Per fault, in one transaction: claim it with ``UPDATE ... SET policy_at WHERE policy_at IS NULL``
       (0 rows: a concurrent pass has it), decide, record the ``policy`` event, carry out a written rule.
    """
    now = now or timezone.now()
    pending = list(Fault.objects.filter(policy_at__isnull=True, job__status__in=ACTIVE_STATUSES)
                   .select_related("cycle").order_by("at", "id")[:1000])
    return _decide_all(pending, now)


def apply_job_policies(job: Job, now: datetime | None = None) -> int:
    """``apply_policies`` for one job's undecided faults (the launcher's supervise pass runs it before it
    decides how an attempt that ended goes on, so a trainer fault's rule is never overtaken)."""
    pending = list(Fault.objects.filter(job=job, policy_at__isnull=True).select_related("cycle")
                   .order_by("at", "id")[:1000])
    acted = _decide_all(pending, now or timezone.now())
    job.refresh_from_db()
    return acted


def _decide_all(pending: list[Fault], now: datetime) -> int:
    jobs = {j.pk: j for j in Job.objects.filter(pk__in={f.job_id for f in pending})}
    acted = 0
    for f in pending:
        job = jobs[f.job_id]
        try:
            with transaction.atomic():
                if not Fault.objects.filter(pk=f.pk, policy_at__isnull=True).update(policy_at=now):
                    continue
                job.refresh_from_db()
                d = decide_fault(job, f)
                record(job, d, key=f"f{f.pk}", subject=fault_subject(f), rank=f.rank, now=now, fault_id=f.pk)
                if job.is_active:
                    acted += carry_out(job, d, key=f"f{f.pk}", subject=fault_subject(f), rank=f.rank, now=now)
        except Exception:  # one job's failure must not stop the others' decisions
            log.exception("failure policy: deciding fault %s of job %s failed", f.pk, f.job_id)
    return acted


def apply_to_straggler(job: Job, rank: int, slowdown_pct: float, now: datetime) -> bool:
    """A rank just marked a straggler: a written rule for ``straggler`` (notify, restart in-job) acts;
    without one, the mark is all (no event beyond the straggler's own)."""
    spec = job.job_spec
    if not spec.failure_policy:
        return False
    facts = Facts(fault_class=STRAGGLER, text=f"{slowdown_pct:.0f} %")
    marked = Event.objects.filter(job=job, kind="straggler", data__state="marked").count()  # this one too
    counts = [marked if r.match.matches(facts) else 0 for r in spec.failure_policy]
    d = decide(spec.failure_policy, facts, counts, budget(job, spec))
    if not d.written:
        return False
    subject = f"straggler rank {rank} ({slowdown_pct:.0f} % slower)"
    key = f"s{rank}-{now.timestamp():.3f}"
    record(job, d, key=key, subject=subject, rank=rank, now=now)
    return carry_out(job, d, key=key, subject=subject, rank=rank, now=now)


__all__ = ["POLICY_EVENT", "NextRow", "apply_job_policies", "apply_policies", "apply_to_straggler", "budget",
           "carry_out", "decide_fault", "decide_launch", "facts_of", "launch_facts", "record", "rule_counts",
           "storm_cycles", "what_next"]
