"""The job: its spec, status and lifecycle times, progress facts, and its ingest token.

The statuses (``JobStatus``, ``ACTIVE_STATUSES``, ``FINAL_STATUSES``) and the words for restart layers
(``LAYER_WORDS``) live here because everything else about a job is read against them.
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

from controlplane.jobs.spec import JobSpec, Timeouts

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
