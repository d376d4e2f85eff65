"""What the ranks report: one row per rank (its freshest heartbeat, deadlines and the watchdog's
claims), the sampled training history the charts draw, and heartbeat state the flush could not write.

``Rank.health_at`` and ``RankQuerySet.ok_or_late`` are the one judgement of a rank's health from its
facts and ``now``, in Python and in SQL (no I/O in the former).
"""

from __future__ import annotations

from datetime import datetime

from django.db import models
from django.utils import timezone

from controlplane.jobs.models.job import ACTIVE_STATUSES, Job
from trainer.wire import Phase


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
        # Late: more than half-way to the deadline.
        if (self.last_heartbeat_at and self.stale_at
                and now - self.last_heartbeat_at > (self.stale_at - self.last_heartbeat_at) / 2):
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
