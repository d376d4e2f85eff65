"""The control plane's own health: outages of its parts and dependencies, and the beacons that show
its processes work (``jobs.outages`` reads and writes them)."""

from __future__ import annotations

from django.db import models


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
