"""The facts a job's events carry: every event as sent, and what ingest derives from the new ones
(``jobs.ingestion``): restart cycles, faults and checkpoints.

Each row keeps times and steps only; the figures (recovery, detection, steps lost) are computed from
them by methods with no I/O.
"""

from __future__ import annotations

from datetime import datetime

from django.db import models
from django.utils import timezone

from controlplane.jobs.lost import cycle_steps_lost
from controlplane.jobs.models.job import LAYER_WORDS, Job
from trainer.wire import CheckpointState, FaultClass, Layer


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
    ``jobs.restart_cycles``). A restart an operator asked for starts at the command's issue time
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
