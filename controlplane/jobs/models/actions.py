"""What is done to a job and who is told: commands (trainer-bound, or carried out by a task), the audit
trail of what people did, and the notification outbox.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone

from controlplane.jobs.models.job import Job
from trainer.wire import CommandKind


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
