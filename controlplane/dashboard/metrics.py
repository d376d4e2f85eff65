"""``/metrics``: Prometheus text format (version 0.0.4) for active jobs and jobs finished in the last hour,
written by prometheus_client from one collector (``JobCollector``) that runs a fixed number of grouped
queries per scrape, however many ranks and checkpoints the jobs have.

Auth: with ``UNBROKEN_METRICS_TOKEN`` (or ``UNBROKEN_METRICS_TOKEN_FILE``) set, a scraper must send
``Authorization: Bearer <token>``. Without it, only clients of ``UNBROKEN_METRICS_ALLOW_NETWORKS`` (by the
connection's address, never X-Forwarded-For; default loopback) and signed-in users may read; anything
else gets 403 naming the variables to set.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.core.cache import cache
from django.db.models import Count, DurationField, ExpressionWrapper, F, Min, Q, Sum, Value
from django.http import HttpResponse
from django.utils import timezone
from django.views.decorators.http import require_GET
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from controlplane.jobs import outages, readouts
from controlplane.jobs.goodput import PARTS
from controlplane.jobs.models import Checkpoint, Fault, Job, Outage, QuarantinedHeartbeat, Rank, RestartCycle
from controlplane.supervisor import read_state
from trainer.wire import CheckpointState

BLOCKING_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DURABLE_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
AGE_BUCKETS = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 3600.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def metrics_token() -> str:
    path = os.environ.get("UNBROKEN_METRICS_TOKEN_FILE")
    if path:
        return Path(path).read_text().strip()
    return os.environ.get("UNBROKEN_METRICS_TOKEN", "")


def from_allowed_network(request) -> bool:
    """Whether the connection's address (REMOTE_ADDR, not a header) is in UNBROKEN_METRICS_ALLOW_NETWORKS."""
    try:
        addr = ipaddress.ip_address(request.META.get("REMOTE_ADDR") or "")
    except ValueError:
        return False
    if getattr(addr, "ipv4_mapped", None):
        addr = addr.ipv4_mapped
    return any(addr in ipaddress.ip_network(n, strict=False) for n in settings.METRICS_ALLOW_NETWORKS)


def scraper_allowed(request) -> tuple[bool, int, str]:
    """/metrics' rule without the session: the token when one is set, else the allowed networks."""
    token = metrics_token()
    if token:
        sent = request.headers.get("Authorization", "")
        if sent.startswith("Bearer ") and hmac.compare_digest(sent[7:].strip(), token):
            return True, 200, ""
        return False, 401, "send Authorization: Bearer <UNBROKEN_METRICS_TOKEN>\n"
    if from_allowed_network(request):
        return True, 200, ""
    return (False, 403, "metrics are open to UNBROKEN_METRICS_ALLOW_NETWORKS (default: loopback) only; set "
                        "UNBROKEN_METRICS_TOKEN or allow the scraper's network\n")


def _allowed(request) -> tuple[bool, int, str]:
    ok, status, why = scraper_allowed(request)
    if ok or request.user.is_authenticated:
        return True, 200, ""
    return ok, status, why


def _histogram(qs, value, buckets: tuple[float, ...], *,
               duration: bool = False) -> dict[int, tuple[list, float]]:
    """Per job: cumulative bucket counts of ``value`` and their sum, counted by the database (one grouped
    query; no row reaches Python). ``duration``: ``value`` is an interval, compared against timedeltas."""
    def bound(le: float):
        return timedelta(seconds=le) if duration else le

    aggs = {f"b{i}": Count("pk", filter=Q(**{"v__lte": bound(le)})) for i, le in enumerate(buckets)}
    rows = (qs.annotate(v=value).filter(v__isnull=False).values("job_id")
            .annotate(n=Count("pk"), s=Sum("v"), **aggs))
    out = {}
    for r in rows:
        total = r["s"].total_seconds() if isinstance(r["s"], timedelta) else float(r["s"] or 0.0)
        counts = [(_le(le), r[f"b{i}"]) for i, le in enumerate(buckets)] + [("+Inf", r["n"])]
        out[r["job_id"]] = (counts, total)
    return out


def _le(v: float) -> str:
    return repr(float(v))


GOODPUT_CACHE_S = 30.0  # goodput reads a job's cycles, checkpoints and ranks: at most this often per job


def _goodput(job: Job, now) -> dict[str, float]:
    key = f"metrics:goodput:{job.pk}"
    shares = cache.get(key)
    if shares is None:
        shares = job.goodput(now)
        cache.set(key, shares, GOODPUT_CACHE_S)
    return shares


class JobCollector:
    """The families of ``/metrics``, built per scrape from grouped queries. Labels are bounded: the job id,
    and the layer, fault class, goodput part or histogram bucket (each a short fixed list). Per-rank detail
    is a histogram per job (heartbeat ages) plus the oldest age, so 100,000 ranks make as many series as 2."""

    def __init__(self, now):
        self.now = now

    def collect(self):
        now = self.now
        recent = Q(finished_at__isnull=True) | Q(finished_at__gte=now - timedelta(hours=1))
        jobs = list(Job.objects.filter(recent).order_by("id").only(
            "pk", "status", "last_step", "started_at", "created_at", "finished_at", "first_step_at", "spec"))
        ids = [j.pk for j in jobs]
        yield from self._progress(jobs)
        yield from self._restarts_and_faults(ids)
        yield from self._checkpoints(jobs, ids)
        yield from self._goodput_shares(jobs)
        yield from self._quarantined(ids)
        yield from self._heartbeats(ids)
        yield from self._stragglers(jobs)

    def _progress(self, jobs: list[Job]):
        step = GaugeMetricFamily("unbroken_job_step", "Last completed training step.", labels=["job"])
        active = GaugeMetricFamily("unbroken_job_active", "1 while the job runs (launching, running, "
                                   "recovering), 0 in the hour after it ended.", labels=["job"])
        for j in jobs:
            step.add_metric([str(j.pk)], j.last_step)
            active.add_metric([str(j.pk)], 1 if j.is_active else 0)
        yield step
        yield active

    def _restarts_and_faults(self, ids: list[int]):
        restarts = CounterMetricFamily("unbroken_restarts", "Restart cycles, by the layer that handled them.",
                                       labels=["job", "layer"])
        for job_id, layer, n in (RestartCycle.objects.filter(job_id__in=ids).values_list("job_id", "layer")
                                 .annotate(n=Count("id")).order_by("job_id", "layer")):
            restarts.add_metric([str(job_id), layer], n)
        yield restarts

        faults = CounterMetricFamily("unbroken_faults", "Faults, by class.", labels=["job", "class"])
        for job_id, cls, n in (Fault.objects.filter(job_id__in=ids).values_list("job_id", "fault_class")
                               .annotate(n=Count("id")).order_by("job_id", "fault_class")):
            faults.add_metric([str(job_id), cls], n)
        yield faults

    def _checkpoints(self, jobs: list[Job], ids: list[int]):
        checkpoints = Checkpoint.objects.filter(job_id__in=ids)
        for name, help_, hist in (
            ("unbroken_checkpoint_blocking_seconds", "Time the training loop waited on a save.",
             _histogram(checkpoints, F("blocking_s"), BLOCKING_BUCKETS)),
            ("unbroken_checkpoint_durable_seconds", "Save start to durable (committed).",
             _histogram(checkpoints.filter(state=CheckpointState.DURABLE, finished_at__isnull=False),
                        ExpressionWrapper(F("finished_at") - F("started_at"), output_field=DurationField()),
                        DURABLE_BUCKETS, duration=True)),
        ):
            fam = HistogramMetricFamily(name, help_, labels=["job"])
            buckets = BLOCKING_BUCKETS if "blocking" in name else DURABLE_BUCKETS
            empty = ([(_le(le), 0) for le in buckets] + [("+Inf", 0)], 0.0)
            for j in jobs:
                counts, total = hist.get(j.pk, empty)
                fam.add_metric([str(j.pk)], counts, total)
            yield fam

    def _goodput_shares(self, jobs: list[Job]):
        now = self.now
        shares = {j.pk: _goodput(j, now) for j in jobs}
        goodput = GaugeMetricFamily("unbroken_goodput_ratio", "Productive step time / wall time "
                                    "(definition on the job page).", labels=["job"])
        parts = GaugeMetricFamily("unbroken_wall_time_share", "Share of wall time per goodput part; "
                                  "parts add up to 1.", labels=["job", "part"])
        for j in jobs:
            goodput.add_metric([str(j.pk)], round(shares[j.pk]["goodput"], 6))
            for part in PARTS:
                parts.add_metric([str(j.pk), part], round(shares[j.pk][part], 6))
        yield goodput
        yield parts

    def _quarantined(self, ids: list[int]):
        quarantined = CounterMetricFamily("unbroken_ingest_quarantined", "Heartbeat states the flush "
                                          "could not write and quarantined (reasons on the job page).",
                                          labels=["job"])
        for job_id, n in (QuarantinedHeartbeat.objects.filter(job_id__in=ids).values_list("job_id")
                          .annotate(n=Sum("count")).order_by("job_id")):
            quarantined.add_metric([str(job_id)], n)
        yield quarantined

    def _heartbeats(self, ids: list[int]):
        """Per-rank detail as a histogram of heartbeat ages per job, the oldest age and the lost and stalled
        counts: never a per-rank series."""
        now = self.now
        ranks = Rank.objects.filter(job_id__in=ids, last_heartbeat_at__isnull=False)
        age = ExpressionWrapper(Value(now) - F("last_heartbeat_at"), output_field=DurationField())
        ages = _histogram(ranks, age, AGE_BUCKETS, duration=True)
        fam = HistogramMetricFamily("unbroken_rank_heartbeat_age_seconds",
                                    "Seconds since each rank's last heartbeat, as a histogram per job.",
                                    labels=["job"])
        oldest = GaugeMetricFamily("unbroken_rank_heartbeat_age_max_seconds",
                                   "Seconds since the last heartbeat of the job's quietest rank.",
                                   labels=["job"])
        lost = GaugeMetricFamily("unbroken_ranks_lost", "Ranks the watchdog marked lost.", labels=["job"])
        stalled = GaugeMetricFamily("unbroken_ranks_stalled", "Ranks the watchdog marked stalled.",
                                    labels=["job"])
        per_job = {r["job_id"]: r for r in Rank.objects.filter(job_id__in=ids).values("job_id").annotate(
            first=Min("last_heartbeat_at"), lost=Count("pk", filter=Q(lost_at__isnull=False)),
            stalled=Count("pk", filter=Q(stalled_at__isnull=False)))}
        for job_id in ids:
            if job_id in ages:
                fam.add_metric([str(job_id)], *ages[job_id])
            r = per_job.get(job_id)
            if r is None:
                continue
            if r["first"] is not None:
                oldest.add_metric([str(job_id)], round((now - r["first"]).total_seconds(), 3))
            lost.add_metric([str(job_id)], r["lost"])
            stalled.add_metric([str(job_id)], r["stalled"])
        yield fam
        yield oldest
        yield lost
        yield stalled

    def _stragglers(self, jobs: list[Job]):
        now = self.now
        # Stragglers, live (jobs/rank_health.py's rule on the rows' windowed busy_s): a count and the worst
        # slowdown per job, never a per-rank series.
        straggling = GaugeMetricFamily("unbroken_ranks_straggling", "Ranks whose own work per step is above "
                                       "the other ranks' median by the job's straggler margin.", labels=["job"])
        slowdown = GaugeMetricFamily("unbroken_straggler_slowdown_max_percent", "The slowest straggler's "
                                     "work per step above the other ranks' median, in percent (0: none).",
                                     labels=["job"])
        for j in jobs:
            if not j.is_active:
                continue
            slow = readouts.slowdowns(j, [], now)
            straggling.add_metric([str(j.pk)], len(slow))
            slowdown.add_metric([str(j.pk)], max(slow.values(), default=0.0))
        yield straggling
        yield slowdown


class ControlPlaneCollector:
    """The control plane itself: ``manage.py serve``'s children (when it runs them) and its outages
    (dependencies unreachable, ingest or the watchdog stopped: ``jobs.outages``)."""

    def __init__(self, now):
        self.now = now

    def collect(self):
        state = read_state(settings.DATA_DIR)
        if state is not None:
            restarts = CounterMetricFamily("unbroken_process_restarts", "Times manage.py serve restarted a "
                                           "control-plane process after it exited.", labels=["process"])
            up = GaugeMetricFamily("unbroken_process_up", "1 while the supervised control-plane process runs.",
                                   labels=["process"])
            for name, c in sorted(state["children"].items()):
                restarts.add_metric([name], c["restarts"])
                up.add_metric([name], int(c["alive"]))
            yield restarts
            yield up
        counts = outages.outage_counts()
        open_ = {o["component"] for o in outages.open_outages(self.now)}
        total = CounterMetricFamily("unbroken_control_plane_outages", "Outages of the control plane's own "
                                    "parts and dependencies, by component.", labels=["component"])
        degraded = GaugeMetricFamily("unbroken_control_plane_degraded", "1 while a component is in an open "
                                     "outage.", labels=["component"])
        for c in Outage.Component:
            total.add_metric([c.value], counts.get(c.value, 0))
            degraded.add_metric([c.value], int(c.value in open_))
        yield total
        yield degraded


def render_metrics(now) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(JobCollector(now))
    registry.register(ControlPlaneCollector(now))
    return generate_latest(registry)


@require_GET
def metrics(request):
    ok, status, why = _allowed(request)
    if not ok:
        resp = HttpResponse(why, status=status, content_type="text/plain")
        if status == 401:
            resp["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return resp
    return HttpResponse(render_metrics(timezone.now()), content_type=CONTENT_TYPE)
