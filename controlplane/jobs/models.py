"""The core domain: jobs, ranks, events, restart cycles, faults, checkpoints, commands, audit.

Stored columns are facts (times, steps, phases) plus denormalised deadlines (``Rank.stale_at``,
``Rank.stall_at``) that make "is it overdue" one indexed query. Health is computed from facts and
``now`` by methods with no I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import datetime
from functools import cached_property

from django.conf import settings
from django.db import models
from django.utils import timezone

from controlplane.jobs.lost import cycle_steps_lost
from controlplane.jobs.spec import JobSpec, Timeouts
from trainer.wire import CheckpointState, CommandKind, FaultClass, Layer, Phase

TOKEN_PREFIX = "ubk_"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class JobStatus(models.TextChoices):
    PENDING = "pending"
    LAUNCHING = "launching"
    RUNNING = "running"
    RECOVERING = "recovering"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


# How people call the restart layers (reasons, hovers, tables).
LAYER_WORDS = {"in_process": "in-process", "in_job": "in-job", "job": "whole job", "none": "none (stopped)"}

ACTIVE_STATUSES = (JobStatus.PENDING, JobStatus.LAUNCHING, JobStatus.RUNNING, JobStatus.RECOVERING)
FINAL_STATUSES = (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED)


class JobQuerySet(models.QuerySet):
    def active(self):
        return self.filter(status__in=ACTIVE_STATUSES)


class Job(models.Model):
    name = models.CharField(max_length=100)
    spec = models.JSONField()
    backend = models.CharField(max_length=20, default="local")
    status = models.CharField(max_length=20, choices=JobStatus.choices, default=JobStatus.PENDING)
    status_reason = models.CharField(max_length=500, blank=True)
    status_changed_at = models.DateTimeField(default=timezone.now)
    token_hash = models.CharField(max_length=64, editable=False)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    first_step_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # Progress facts, maintained by ingest.
    last_step = models.IntegerField(default=0)
    max_step = models.IntegerField(default=0)
    last_progress_at = models.DateTimeField(null=True, blank=True)
    # Job-level attempts (new processes or pods); 0 is the first launch.
    attempt = models.IntegerField(default=0)
    # What the launcher needs to find its processes or objects again (pids, log path, k8s names).
    launcher_state = models.JSONField(default=dict, blank=True)
    # Notifications, per job.
    notify_webhook_url = models.URLField(blank=True)
    notify_email = models.EmailField(blank=True)

    objects = JobQuerySet.as_manager()

    class Meta:
        indexes = [models.Index(fields=["status"])]
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"#{self.pk} {self.name}"

    @cached_property
    def job_spec(self) -> JobSpec:
        """The stored spec, typed: every read of a job's settings goes through it (decoded once per row)."""
        return JobSpec.from_stored(self.spec)

    @property
    def world_size(self) -> int:
        return self.job_spec.world_size

    @property
    def timeouts(self) -> Timeouts:
        """The supervision timeouts of the spec (step, checkpoint, stall)."""
        return Timeouts.of(self.job_spec)

    @property
    def is_active(self) -> bool:
        return self.status in ACTIVE_STATUSES

    @property
    def step_shown(self) -> int:
        """The step the pages show: the current one while the job runs (it drops with a rollback), the
        highest reached once it is over (a relaunch that never stepped reads 0 otherwise)."""
        return self.last_step if self.is_active else max(self.last_step, self.max_step)

    def issue_token(self) -> str:
        """Make a new ingest token; only its hash is stored. Returns the token (show it once)."""
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        self.token_hash = hash_token(token)
        return token

    @staticmethod
    def revoke_token(job_id: int, attempt: int) -> bool:
        """The attempt's processes are gone: its ingest token stops working (a token printed into a log
        is worthless after its attempt). Conditional on the attempt, so a later attempt's token stays."""
        qs = Job.objects.filter(pk=job_id, attempt=attempt).exclude(token_hash="")
        return qs.update(token_hash="") == 1

    def token_matches(self, token: str) -> bool:
        return hmac.compare_digest(self.token_hash, hash_token(token))

    def rank_nodes(self) -> dict[int, str]:
        """rank -> the node its heartbeats named (ranks that named none are left out)."""
        return dict(self.ranks.exclude(node="").values_list("rank", "node"))

    @staticmethod
    def last_progress_of(job_id: int) -> datetime | None:
        """``last_progress_at`` as the database has it now (the heartbeat stores move it with an UPDATE)."""
        return Job.objects.filter(pk=job_id).values_list("last_progress_at", flat=True).first()

    def goodput(self, now: datetime | None = None) -> dict[str, float]:
        from controlplane.jobs.goodput import compute_goodput

        return compute_goodput(self, now or timezone.now())


class RankQuerySet(models.QuerySet):
    def overdue(self, now: datetime):
        """Ranks past their heartbeat deadline and not yet marked lost."""
        return self.filter(stale_at__lt=now, lost_at__isnull=True, job__status__in=ACTIVE_STATUSES)

    def stalled(self, now: datetime):
        return self.filter(stall_at__lt=now, stalled_at__isnull=True, lost_at__isnull=True,
                           job__status__in=ACTIVE_STATUSES)

    def ok_or_late(self, now: datetime):
        """The rows ``Rank.health_at(now)`` judges ok or late, in SQL (a pass over 100,000 ranks reads
        numbers, not rows); tests/controlplane/jobs/test_stragglers.py holds the two to the same answer."""
        return self.exclude(phase=Phase.STOPPED).filter(
            models.Q(stale_at__isnull=True) | models.Q(stale_at__gte=now),
            models.Q(stall_at__isnull=True) | models.Q(stall_at__gte=now),
            lost_at__isnull=True, stalled_at__isnull=True)


class RankHealth(models.TextChoices):
    OK = "ok"
    LATE = "late"
    LOST = "lost"
    STALLED = "stalled"
    STOPPED = "stopped"
    STRAGGLER = "straggler"  # alive and stepping, but its own work per step is above the job's median


class Rank(models.Model):
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="ranks")
    rank = models.IntegerField()
    node = models.CharField(max_length=253, blank=True)
    pid = models.IntegerField(null=True, blank=True)
    phase = models.CharField(max_length=20, choices=[(p.value, p.value) for p in Phase], default=Phase.INIT)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    last_step = models.IntegerField(default=0)
    step_changed_at = models.DateTimeField(null=True, blank=True)
    loss = models.FloatField(null=True, blank=True)
    step_time_s = models.FloatField(null=True, blank=True)
    tokens_per_s = models.FloatField(null=True, blank=True)
    # The rank's own work per step over the straggler window (``wire.Heartbeat.busy_s``).
    busy_s = models.FloatField(null=True, blank=True)
    # Deadlines (denormalised so the watchdog is one indexed query).
    stale_at = models.DateTimeField(null=True, blank=True)
    stall_at = models.DateTimeField(null=True, blank=True)
    # Claims made by the watchdog; cleared by the next heartbeat that shows life / progress.
    lost_at = models.DateTimeField(null=True, blank=True)
    stalled_at = models.DateTimeField(null=True, blank=True)
    # When the watchdog marked it a straggler (jobs/stragglers.py); cleared when it recovers.
    straggler_at = models.DateTimeField(null=True, blank=True)

    objects = RankQuerySet.as_manager()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["job", "rank"], name="uniq_rank_per_job")]
        indexes = [
            models.Index(fields=["stale_at"], name="rank_stale_open", condition=models.Q(lost_at__isnull=True)),
            models.Index(fields=["stall_at"], name="rank_stall_open", condition=models.Q(stalled_at__isnull=True)),
        ]
        ordering = ["job", "rank"]

    def __str__(self) -> str:
        return f"job {self.job_id} rank {self.rank}"

    def health_at(self, now: datetime) -> str:
        if self.phase == Phase.STOPPED:
            return RankHealth.STOPPED
        if self.lost_at or (self.stale_at and self.stale_at < now):
            return RankHealth.LOST
        if self.stalled_at or (self.stall_at and self.stall_at < now):
            return RankHealth.STALLED
        if self.last_heartbeat_at and self.stale_at:
            # Late: more than half-way to the deadline.
            if now - self.last_heartbeat_at > (self.stale_at - self.last_heartbeat_at) / 2:
                return RankHealth.LATE
        return RankHealth.OK

    def heartbeat_age_s(self, now: datetime) -> float | None:
        return (now - self.last_heartbeat_at).total_seconds() if self.last_heartbeat_at else None


class TrainingSample(models.Model):
    """Loss and throughput over time: one heartbeat kept every few seconds per job (ingestion samples
    them), so charts have a history without storing every heartbeat."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="samples")
    at = models.DateTimeField()
    rank = models.IntegerField()
    step = models.IntegerField()
    loss = models.FloatField(null=True, blank=True)
    step_time_s = models.FloatField(null=True, blank=True)
    tokens_per_s = models.FloatField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["job", "at"])]
        ordering = ["job", "at"]


class Event(models.Model):
    """Every accepted event, as sent (the raw facts). Unique per (job, event_id): retries are no-ops."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="events")
    event_id = models.CharField(max_length=64)
    kind = models.CharField(max_length=20)
    rank = models.IntegerField(null=True, blank=True)
    at = models.DateTimeField()
    received_at = models.DateTimeField(default=timezone.now)
    source = models.CharField(max_length=128, blank=True)
    data = models.JSONField(default=dict)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["job", "event_id"], name="uniq_event_per_job")]
        # (job, kind, at): the job page reads events of one kind (policy decisions, stragglers, launcher
        # facts); without it a job-wide restart's 600,000 cycle marks were scanned on every load.
        indexes = [models.Index(fields=["job", "at"]), models.Index(fields=["job", "id"]),
                   models.Index(fields=["job", "kind", "at"])]
        ordering = ["at", "id"]


class RestartCycle(models.Model):
    """One recovery: from the fault to the first completed step after it, handled by one layer.

    ``step_at_fault`` and ``resumed_from_step`` are the trainer's own numbers: the last step the rank
    completed before the fault (fault facts and the ``fault_at`` mark carry it) and the checkpoint step
    it loaded (the ``checkpoint_loaded_at`` mark; at Level 0/1, the first step after the restart minus
    one). An older trainer that sends no step gets the control plane's freshest step instead (see
    ``ingestion._apply_cycles``). A restart an operator asked for starts at the command's issue time
    (``fault_at``) and spends ``fault_at`` → ``delivered_at`` waiting for the trainer to fetch it.
    """

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="cycles")
    key = models.CharField(max_length=64)
    layer = models.CharField(max_length=20, choices=[(x.value, x.value) for x in Layer], default=Layer.NONE)
    reason = models.CharField(max_length=200, blank=True)
    fault_at = models.DateTimeField(null=True, blank=True)
    detected_at = models.DateTimeField(null=True, blank=True)
    aborted_at = models.DateTimeField(null=True, blank=True)
    restarted_at = models.DateTimeField(null=True, blank=True)
    checkpoint_loaded_at = models.DateTimeField(null=True, blank=True)
    first_step_at = models.DateTimeField(null=True, blank=True)
    resumed_from_step = models.IntegerField(null=True, blank=True)
    step_at_fault = models.IntegerField(null=True, blank=True)
    # An older trainer's fault carries no step: the control plane's freshest step when the cycle opened
    # stands in (read only while ``step_at_fault`` is unknown, so a late fact still wins).
    step_at_fault_estimate = models.IntegerField(null=True, blank=True)
    command = models.ForeignKey("Command", null=True, blank=True, on_delete=models.SET_NULL,
                                related_name="cycles")
    delivered_at = models.DateTimeField(null=True, blank=True)  # a command's: when the trainer fetched it
    # Where the restart's state came from (wire.RestoredFrom: memory | local | disk); "" = not reported.
    restored_from = models.CharField(max_length=8, blank=True)
    # Set when this layer gave up and a later cycle (by key) recovered instead: e.g. an in-process
    # restart that a SIGKILL cut short, finished by ft_launcher. Its first_step_at is then its last mark.
    escalated_to = models.CharField(max_length=64, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["job", "key"], name="uniq_cycle_per_job")]
        ordering = ["job", "fault_at", "id"]

    def __str__(self) -> str:
        return f"cycle {self.key} ({self.layer})"

    @property
    def start_at(self) -> datetime | None:
        return self.fault_at or self.detected_at or self.aborted_at or self.restarted_at

    @property
    def title(self) -> str:
        """The cycle in words ("in-job restart"); its key (``a0-ij1``) is an internal id."""
        if self.layer == Layer.NONE:
            return "restart (layer not known yet)"
        return f"{LAYER_WORDS.get(self.layer, self.layer)} restart"

    @property
    def recovery_s(self) -> float | None:
        if self.first_step_at and self.start_at:
            return max(0.0, (self.first_step_at - self.start_at).total_seconds())
        return None

    @property
    def detection_s(self) -> float | None:
        if self.detected_at and self.fault_at:
            return max(0.0, (self.detected_at - self.fault_at).total_seconds())
        return None

    @property
    def lost_steps(self) -> int | None:
        """Steps recomputed because of this cycle (every view and goodput's lost work read this)."""
        return self.steps_lost()

    def steps_lost(self, *, durable_step: int | None = None) -> int | None:
        """``lost.cycle_steps_lost`` of this cycle's facts."""
        return cycle_steps_lost(step_at_fault=self.step_at_fault,
                                step_at_fault_estimate=self.step_at_fault_estimate,
                                resumed_from_step=self.resumed_from_step, durable_step=durable_step)

    def durations(self) -> dict[str, float | None]:
        """Seconds spent in each phase of the cycle: (for a command: deliver), detect, abort, restart,
        reload, first step."""
        marks = [self.fault_at, self.detected_at, self.aborted_at, self.restarted_at,
                 self.checkpoint_loaded_at, self.first_step_at]
        names = ["detect", "abort", "restart", "reload", "first_step"]
        if self.delivered_at is not None:
            marks.insert(1, self.delivered_at)
            names.insert(0, "deliver")
        out: dict[str, float | None] = {}
        for name, a, b in zip(names, marks, marks[1:], strict=False):
            out[name] = max(0.0, (b - a).total_seconds()) if a and b else None
        return out


class Fault(models.Model):
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="faults")
    cycle = models.ForeignKey(RestartCycle, null=True, blank=True, on_delete=models.SET_NULL, related_name="faults")
    fault_class = models.CharField(max_length=20, choices=[(f.value, f.value) for f in FaultClass])
    rank = models.IntegerField(null=True, blank=True)
    node = models.CharField(max_length=253, blank=True)
    detected_by = models.CharField(max_length=40)
    message = models.TextField(blank=True)
    at = models.DateTimeField()
    detected_at = models.DateTimeField(default=timezone.now)
    lost_steps = models.IntegerField(null=True, blank=True)
    # Idempotency: the event id (trainer) or a claim key (watchdog, launcher) that produced this fault.
    source_key = models.CharField(max_length=100)
    # When the failure policy decided this fault (``jobs.policy``: claimed by a conditional UPDATE).
    policy_at = models.DateTimeField(null=True, blank=True)
    # The job's last step progress when this fault was recorded, never later than ``at`` (null: none yet).
    # A rule counting faults "without progress" counts those since it: progress the job makes after the
    # fault (its own recovery) must not drop the fault from its own count.
    progress_at = models.DateTimeField(null=True, blank=True)
    # Attribution (``jobs.attribution``): a primary fault has no ``primary``; a consequence (a peer's
    # echo of it: a gloo or NCCL error, ft_launcher's SIGTERM) or a repeat (the same failure again on the
    # next restart, with no step progress between) points at it, with ``link`` saying which and ``why``
    # in words. ``count`` is a primary's occurrences (itself and its repeats). Revisited whenever a fault
    # of the same failure arrives (a killed rank's exit is seen after its peers' exceptions).
    primary = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL,
                                related_name="echoes")
    link = models.CharField(max_length=12, blank=True, choices=[("consequence", "consequence"),
                                                                ("repeat", "repeat")])
    why = models.CharField(max_length=300, blank=True)
    count = models.IntegerField(default=1)
    attributed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["job", "source_key"], name="uniq_fault_source")]
        indexes = [models.Index(fields=["job", "at"]),
                   models.Index(fields=["job"], name="fault_policy_open", condition=models.Q(policy_at__isnull=True))]
        ordering = ["-at", "-id"]

    @property
    def detection_s(self) -> float:
        return max(0.0, (self.detected_at - self.at).total_seconds())

    @staticmethod
    def progress_before(job_id: int, at: datetime) -> datetime | None:
        """``progress_at`` for a fault of ``job_id`` at ``at``: the job's last step progress, read now."""
        return Fault.clip_progress(Job.last_progress_of(job_id), at)

    @staticmethod
    def clip_progress(last: datetime | None, at: datetime) -> datetime | None:
        """``progress_at`` from the job's last step progress ``last`` (already read): never after ``at``."""
        return None if last is None else min(last, at)


class Checkpoint(models.Model):
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="checkpoints")
    step = models.IntegerField()
    attempt_key = models.CharField(max_length=64, default="", blank=True)
    mode = models.CharField(max_length=10, default="async")
    state = models.CharField(max_length=20, choices=[(s.value, s.value) for s in CheckpointState],
                             default=CheckpointState.IN_FLIGHT)
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)
    blocking_s = models.FloatField(null=True, blank=True)
    write_s = models.FloatField(null=True, blank=True)
    bytes = models.BigIntegerField(null=True, blank=True)
    # Async: the extra time of the steps that overlapped the background save (trainer-measured).
    interference_s = models.FloatField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["job", "step", "attempt_key"], name="uniq_ckpt")]
        indexes = [models.Index(fields=["job", "started_at"])]
        ordering = ["job", "started_at"]

    @property
    def durable_latency_s(self) -> float | None:
        if self.state == CheckpointState.DURABLE and self.finished_at:
            return (self.finished_at - self.started_at).total_seconds()
        return None


class CommandStatus(models.TextChoices):
    PENDING = "pending"  # waiting for the trainer's next ingest (or the launcher task)
    DELIVERED = "delivered"  # sent in an ingest response at least once
    ACKED = "acked"  # the trainer acknowledged it
    FAILED = "failed"
    DONE = "done"  # carried out by the control plane (stop, job-level restart)


class Command(models.Model):
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="commands")
    kind = models.CharField(max_length=20, choices=[(c.value, c.value) for c in CommandKind])
    level = models.CharField(max_length=20, blank=True)  # for restarts: a Layer
    fault = models.CharField(max_length=20, blank=True)  # for inject_fault: a DrillFault
    rank = models.IntegerField(null=True, blank=True)
    status = models.CharField(max_length=20, choices=CommandStatus.choices, default=CommandStatus.PENDING)
    detail = models.TextField(blank=True)
    issued_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    issued_at = models.DateTimeField(default=timezone.now)
    delivered_at = models.DateTimeField(null=True, blank=True)
    acked_at = models.DateTimeField(null=True, blank=True)
    # Trainer-bound commands travel in ingest responses; the others are carried out by a Celery task.
    via_trainer = models.BooleanField(default=True)

    class Meta:
        indexes = [models.Index(fields=["job", "status"])]
        ordering = ["-issued_at", "-id"]

    def to_wire(self) -> dict:
        return {"id": self.pk, "kind": self.kind, "level": self.level or None, "fault": self.fault or None,
                "rank": self.rank, "issued_at": self.issued_at.timestamp()}


class AuditEntry(models.Model):
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    actor_name = models.CharField(max_length=150)
    action = models.CharField(max_length=50)
    job = models.ForeignKey(Job, null=True, blank=True, on_delete=models.SET_NULL, related_name="audit")
    at = models.DateTimeField(default=timezone.now)
    detail = models.JSONField(default=dict, blank=True)
    remote_addr = models.GenericIPAddressField(null=True, blank=True)

    class Meta:
        ordering = ["-at", "-id"]
        verbose_name_plural = "audit entries"


class Notification(models.Model):
    """Outbox: one row per (job, transition, channel); a sender claims and sends each exactly once."""

    class Transition(models.TextChoices):
        FAILED = "failed"
        STALLED = "stalled"
        STORM = "storm"
        RECOVERED = "recovered"
        POLICY = "policy"  # a failure-policy rule with the notify action fired

    class Channel(models.TextChoices):
        WEBHOOK = "webhook"
        EMAIL = "email"

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="notifications")
    transition = models.CharField(max_length=20, choices=Transition.choices)
    transition_key = models.CharField(max_length=100)  # e.g. "stalled:<rank>:<at>"; dedupes repeats
    channel = models.CharField(max_length=10, choices=Channel.choices)
    target = models.CharField(max_length=500)
    payload = models.JSONField()
    created_at = models.DateTimeField(default=timezone.now)
    claimed_at = models.DateTimeField(null=True, blank=True)
    sent_at = models.DateTimeField(null=True, blank=True)
    attempts = models.IntegerField(default=0)
    last_error = models.TextField(blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["job", "transition_key", "channel"], name="uniq_notification")]
        indexes = [models.Index(fields=["sent_at"], name="notification_unsent", condition=models.Q(sent_at__isnull=True))]


class QuarantinedHeartbeat(models.Model):
    """Heartbeat state the flush could not write (left in Redis by an older server, or refused by the
    database): one row per (job, rank) with the latest reason and raw state, and how often it happened.
    ``rank`` is null for the job's progress state, and for the ranks past ``PER_JOB`` rows."""

    PER_JOB = 100

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="quarantined")
    rank = models.IntegerField(null=True, blank=True)
    reason = models.TextField()
    payload = models.TextField(blank=True)  # the raw state, NULs escaped, truncated
    at = models.DateTimeField(default=timezone.now)
    count = models.IntegerField(default=1)

    class Meta:
        indexes = [models.Index(fields=["job", "rank"])]
        ordering = ["job", "-at"]

    def __str__(self) -> str:
        return f"job {self.job_id} rank {self.rank}: {self.reason}"


class Outage(models.Model):
    """A time the control plane itself was impaired: a fact kept for the deadlines, the job pages, the
    banner and ``/metrics``. ``ingest`` (the web processes stopped ticking) and ``watchdog`` (it did
    not run) and ``shedding`` (ingest over capacity answered 429) are outage grace: that time never counts
    against a rank's heartbeat deadline. ``redis``,
    ``database`` and ``broker`` are dependencies being unreachable (shown and counted). At most one
    open row (``ended_at`` null) per component."""

    class Component(models.TextChoices):
        INGEST = "ingest"
        WATCHDOG = "watchdog"
        REDIS = "redis"
        DATABASE = "database"
        BROKER = "broker"
        SHEDDING = "shedding"  # ingest answered 429: over capacity (``ingest.liveness``)

    GRACE = (Component.INGEST, Component.WATCHDOG, Component.SHEDDING)

    component = models.CharField(max_length=20, choices=Component.choices)
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField(null=True, blank=True)
    detail = models.CharField(max_length=500, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["component"], name="one_open_outage_per_component",
                                               condition=models.Q(ended_at__isnull=True))]
        indexes = [models.Index(fields=["ended_at"]), models.Index(fields=["started_at"])]
        ordering = ["-started_at", "-id"]

    def __str__(self) -> str:
        return f"{self.component} {self.started_at:%H:%M:%S}–{self.ended_at:%H:%M:%S}" if self.ended_at else (
            f"{self.component} since {self.started_at:%H:%M:%S}")


class Beacon(models.Model):
    """When a control-plane process last showed it works: ``watchdog`` (its last pass) and ``ingest``
    (the web processes' ticker). A beacon that falls behind is an outage (``jobs.outages``)."""

    name = models.CharField(max_length=20, primary_key=True)
    at = models.DateTimeField()
