"""``/metrics``: Prometheus text format (version 0.0.4) for active jobs and jobs finished in the last hour.

Auth: with ``UNBROKEN_METRICS_TOKEN`` (or ``UNBROKEN_METRICS_TOKEN_FILE``) set, a scraper must send
``Authorization: Bearer <token>``. Without it, only loopback clients (a Prometheus or agent on the
same host) and signed-in users may read; anything else gets 403 naming the variable to set.
"""

from __future__ import annotations

import hmac
import os
from collections import defaultdict
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.db.models import Count, Q, Sum
from django.http import HttpResponse
from django.utils import timezone
from django.views.decorators.http import require_GET

from controlplane.jobs.goodput import PARTS
from controlplane.jobs import outages
from controlplane.jobs.models import Checkpoint, Fault, Job, Outage, QuarantinedHeartbeat, Rank, RestartCycle
from controlplane.supervisor import read_state
from trainer.wire import CheckpointState

BLOCKING_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DURABLE_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def metrics_token() -> str:
    path = os.environ.get("UNBROKEN_METRICS_TOKEN_FILE")
    if path:
        return Path(path).read_text().strip()
    return os.environ.get("UNBROKEN_METRICS_TOKEN", "")


def _allowed(request) -> tuple[bool, int, str]:
    token = metrics_token()
    if token:
        sent = request.headers.get("Authorization", "")
        if sent.startswith("Bearer ") and hmac.compare_digest(sent[7:].strip(), token):
            return True, 200, ""
        return False, 401, "send Authorization: Bearer <UNBROKEN_METRICS_TOKEN>\n"
    if request.META.get("REMOTE_ADDR") in LOOPBACK or request.user.is_authenticated:
        return True, 200, ""
    return (
        False,
        403,
        "metrics are open to loopback only; set UNBROKEN_METRICS_TOKEN to let remote scrapers in\n",
    )


def _esc(v) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(**kw) -> str:
    return "{" + ",".join(f'{k}="{_esc(v)}"' for k, v in kw.items()) + "}"


def _num(v: float) -> str:
    return repr(float(v)) if isinstance(v, float) else str(v)


class Exposition:
    def __init__(self):
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_: str, /) -> None:
        self.lines.append(f"# HELP {name} {help_}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, metric: str, value, /, **labels) -> None:
        self.lines.append(f"{metric}{_labels(**labels) if labels else ''} {_num(value)}")

    def histogram(self, name: str, values: list[float], buckets: tuple[float, ...], /, **labels) -> None:
        for le in buckets:
            self.sample(f"{name}_bucket", sum(1 for v in values if v <= le), **labels, le=_num(le))
        self.sample(f"{name}_bucket", len(values), **labels, le="+Inf")
        self.sample(f"{name}_sum", float(sum(values)), **labels)
        self.sample(f"{name}_count", len(values), **labels)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def render_metrics(now) -> str:
    jobs = list(
        Job.objects.filter(
            Q(finished_at__isnull=True) | Q(finished_at__gte=now - timedelta(hours=1))
        ).order_by("id")
    )
    ids = [j.pk for j in jobs]
    out = Exposition()

    out.family("unbroken_job_step", "gauge", "Last completed training step.")
    for j in jobs:
        out.sample("unbroken_job_step", j.last_step, job=j.pk, name=j.name, status=j.status)

    out.family("unbroken_restarts_total", "counter", "Restart cycles, by the layer that handled them.")
    for job_id, layer, n in (
        RestartCycle.objects.filter(job_id__in=ids)
        .values_list("job_id", "layer")
        .annotate(n=Count("id"))
        .order_by("job_id", "layer")
    ):
        out.sample("unbroken_restarts_total", n, job=job_id, layer=layer)

    out.family("unbroken_faults_total", "counter", "Faults, by class.")
    for job_id, cls, n in (
        Fault.objects.filter(job_id__in=ids)
        .values_list("job_id", "fault_class")
        .annotate(n=Count("id"))
        .order_by("job_id", "fault_class")
    ):
        out.sample("unbroken_faults_total", n, job=job_id, **{"class": cls})

    blocking: dict[int, list[float]] = defaultdict(list)
    durable: dict[int, list[float]] = defaultdict(list)
    for job_id, started_at, finished_at, blocking_s, state in Checkpoint.objects.filter(
        job_id__in=ids
    ).values_list("job_id", "started_at", "finished_at", "blocking_s", "state"):
        if blocking_s is not None:
            blocking[job_id].append(blocking_s)
        if state == CheckpointState.DURABLE and finished_at is not None:
            durable[job_id].append((finished_at - started_at).total_seconds())
    out.family(
        "unbroken_checkpoint_blocking_seconds", "histogram", "Time the training loop waited on a save."
    )
    for j in jobs:
        out.histogram(
            "unbroken_checkpoint_blocking_seconds", blocking.get(j.pk, []), BLOCKING_BUCKETS, job=j.pk
        )
    out.family("unbroken_checkpoint_durable_seconds", "histogram", "Save start to durable (committed).")
    for j in jobs:
        out.histogram("unbroken_checkpoint_durable_seconds", durable.get(j.pk, []), DURABLE_BUCKETS, job=j.pk)

    out.family(
        "unbroken_goodput_ratio", "gauge", "Productive step time / wall time (definition on the job page)."
    )
    shares = {j.pk: j.goodput(now) for j in jobs}
    for j in jobs:
        out.sample("unbroken_goodput_ratio", round(shares[j.pk]["goodput"], 6), job=j.pk)
    out.family("unbroken_wall_time_share", "gauge", "Share of wall time per goodput part; parts add up to 1.")
    for j in jobs:
        for part in PARTS:
            out.sample("unbroken_wall_time_share", round(shares[j.pk][part], 6), job=j.pk, part=part)

    out.family("unbroken_ingest_quarantined_total", "counter",
               "Heartbeat states the flush could not write and quarantined (reasons on the job page).")
    for job_id, n in (
        QuarantinedHeartbeat.objects.filter(job_id__in=ids)
        .values_list("job_id")
        .annotate(n=Sum("count"))
        .order_by("job_id")
    ):
        out.sample("unbroken_ingest_quarantined_total", n, job=job_id)

    _supervised(out)
    _outages(out, now)

    out.family("unbroken_rank_heartbeat_age_seconds", "gauge", "Seconds since the rank's last heartbeat.")
    for job_id, rank, node, hb in (
        Rank.objects.filter(job_id__in=ids, last_heartbeat_at__isnull=False)
        .values_list("job_id", "rank", "node", "last_heartbeat_at")
        .order_by("job_id", "rank")
    ):
        out.sample(
            "unbroken_rank_heartbeat_age_seconds",
            round((now - hb).total_seconds(), 3),
            job=job_id,
            rank=rank,
            node=node,
        )
    return out.text()


def _outages(out: Exposition, now) -> None:
    """The control plane's own outages (dependencies unreachable, ingest or the watchdog stopped)."""
    counts = outages.outage_counts()
    out.family("unbroken_control_plane_outages_total", "counter",
               "Outages of the control plane's own parts and dependencies, by component.")
    for c in Outage.Component:
        out.sample("unbroken_control_plane_outages_total", counts.get(c.value, 0), component=c.value)
    out.family("unbroken_control_plane_degraded", "gauge", "1 while a component is in an open outage.")
    open_ = {o["component"] for o in outages.open_outages(now)}
    for c in Outage.Component:
        out.sample("unbroken_control_plane_degraded", int(c.value in open_), component=c.value)


def _supervised(out: Exposition) -> None:
    """The ``manage.py serve`` supervisor's children (nothing when the processes run elsewhere)."""
    state = read_state(settings.DATA_DIR)
    if state is None:
        return
    out.family("unbroken_process_restarts_total", "counter",
               "Times manage.py serve restarted a control-plane process after it exited.")
    for name, c in sorted(state["children"].items()):
        out.sample("unbroken_process_restarts_total", c["restarts"], process=name)
    out.family("unbroken_process_up", "gauge", "1 while the supervised control-plane process is running.")
    for name, c in sorted(state["children"].items()):
        out.sample("unbroken_process_up", int(c["alive"]), process=name)


@require_GET
def metrics(request):
    ok, status, why = _allowed(request)
    if not ok:
        resp = HttpResponse(why, status=status, content_type="text/plain")
        if status == 401:
            resp["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return resp
    return HttpResponse(render_metrics(timezone.now()), content_type=CONTENT_TYPE)
