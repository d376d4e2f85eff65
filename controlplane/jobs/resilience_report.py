"""A job's resilience report: which failures it survived, how fast, at what cost, and the goodput to
expect at scale. Built from the job's stored facts with the same model properties and figures the job
page and the operator API read (``RestartCycle.recovery_s``/``durations``/``lost_steps``,
``readouts.fault_figures``, ``Job.goodput``); nothing here measures anything new.

One type serves the page, ``GET /api/v1/jobs/<id>/report`` (its OpenAPI schema is generated from it) and
``manage.py resilience_report``. Every figure carries the cycle keys and fault ids it came from, and the
links to read them through the API.

A restart cycle belongs to the class of its primary fault: the first fault recorded against it (the one
that started the failure; its echoes on other ranks come later). A cycle with no fault is an operator's
restart command. ReportPercentiles are nearest-rank: the p-th of n sorted values is the ceil(p/100 * n)-th.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable
from datetime import datetime

from django.db.models import Min
from django.urls import reverse
from django.utils import timezone
from msgspec import Struct

from controlplane.jobs import projection, readouts
from controlplane.jobs.models import Checkpoint, Fault, Job, RestartCycle, TrainingSample
from trainer.wire import CheckpointMode, CheckpointState, FaultClass, Layer

OPERATOR = "operator_restart"  # the class of a cycle no fault started (an operator's restart command)
PHASES = ("deliver", "detect", "abort", "restart", "reload", "first_step")

# What each integration level lets a drill (and so the report) cover. Level 0: the user's unmodified
# script, supervised from outside; Level 2: the SDK's re-entrant entrypoint with registered state (the
# built-in model is one). Level 1 (a few calls) drills like Level 0 and adds the loss.
LEVEL0_CLASSES = (FaultClass.EXCEPTION, FaultClass.HANG, FaultClass.PROCESS_KILLED)
LEVEL2_CLASSES = (*LEVEL0_CLASSES, FaultClass.NAN_LOSS, "hang_collective", "killed_during_save")
# The classes a level cannot cover, and the SDK lines that would (trainer/unbroken/__init__.py).
NOT_AT_LEVEL0 = (
    ("nan_loss", "the control plane never sees the loss",
     "run = unbroken.init()  ...  run.step(step + 1, loss=loss.item())"),
    ("hang_collective", "a hang inside a collective is only ended by restarting the processes (in-job): "
     "the in-process layer needs a re-entrant entrypoint",
     "@unbroken.entrypoint\ndef train(ctx: unbroken.Context): ctx.init_process_group() ..."),
    ("killed_during_save", "the product cannot tell an interrupted save from a finished one",
     "start = ctx.checkpoint.restore(model=model, optim=optimizer)\n"
     "...\nctx.checkpoint.maybe_save(step + 1)"),
    ("in_process restarts", "every failure restarts the processes (seconds of imports and process-group "
     "setup each time)", "@unbroken.entrypoint  (and in_process: true in the job's spec)"),
)


class ReportPercentiles(Struct, kw_only=True):
    n: int
    p50_s: float | None
    p95_s: float | None


class ReportClass(Struct, kw_only=True):
    """One fault class: the cycles its faults started, the layer that recovered each, and how fast."""

    fault_class: str
    faults: int  # every fault of the class, echoes included
    cycles: list[str]  # keys of the cycles it started (its primary faults)
    layers: dict[str, int]  # layer that recovered (the last of an escalation) -> cycles
    recovered: int  # cycles that reached their first step again
    open: int  # cycles still recovering
    not_recovered: int  # cycles that ended the job (layer none) or never got a cycle
    detection: ReportPercentiles
    recovery: ReportPercentiles
    fault_ids: list[int]
    links: dict[str, str]


class ReportPhase(Struct, kw_only=True):
    name: str
    n: int
    p50_s: float | None
    p95_s: float | None
    total_s: float


class ReportLayer(Struct, kw_only=True):
    layer: str
    cycles: list[str]
    recovery: ReportPercentiles
    mean_recovery_s: float | None


class ReportRecovery(Struct, kw_only=True):
    detection: ReportPercentiles
    recovery: ReportPercentiles
    phases: list[ReportPhase]
    reload_share: float | None  # reload's share of the recovery time (cycles with both)
    by_layer: list[ReportLayer]
    cycles: list[str]
    links: dict[str, str]


class ReportLostRow(Struct, kw_only=True):
    cycle: str
    layer: str
    step_at_fault: int | None
    resumed_from_step: int | None
    lost_steps: int | None


class ReportLost(Struct, kw_only=True):
    interval_steps: int
    rows: list[ReportLostRow]
    mean: float | None
    max: int | None
    # A rollback to the newest checkpoint loses half an interval on average, at most one (plus a save in
    # flight): more than that says saves are failing or slower than the interval.
    beyond_interval: list[str]


class ReportSave(Struct, kw_only=True):
    id: int
    step: int
    mode: str
    state: str
    blocking_s: float | None
    interference_s: float | None
    cost_s: float | None  # what it cost the loop: blocked time plus slower steps


class ReportSaves(Struct, kw_only=True):
    rows: list[ReportSave]
    async_cost: ReportPercentiles
    sync_cost: ReportPercentiles
    cheaper: str | None  # readouts.checkpoint_mode_advice: "async" | "sync" | None (not enough saves)
    save_cost_s: float | None  # the median cost per durable save, the projection's input
    links: dict[str, str]


class ReportUncovered(Struct, kw_only=True):
    fault_class: str
    why: str
    sdk: str


class ReportScenario(Struct, kw_only=True):
    name: str
    recovery_s: float
    recovery_source: str
    goodput_now: float
    best_interval_s: float | None
    best_interval_steps: int | None
    goodput_best: float


class ReportPublished(Struct, kw_only=True):
    layer: str
    recovery_s: float
    goodput_pct: float


class ReportAtScale(Struct, kw_only=True):
    gpus: int
    interruptions: float
    days: float
    on_gpus: int
    rate_source: str
    rate_url: str
    mtbf_s: float | None
    step_time_s: float
    interval_steps: int
    interval_s: float
    save_cost_s: float
    scenarios: list[ReportScenario]
    caveats: list[str]
    published: list[ReportPublished]
    published_source: str


class Report(Struct, kw_only=True):
    """A job's resilience report (see docs/guides/resilience-report.md)."""

    job: int
    name: str
    status: str
    level: int | None  # integration level: 0 (own script), 1, 2 (SDK entrypoint; the built-in model)
    generated_at: datetime
    classes: list[ReportClass]
    supported: list[str]  # the classes a drill plan can inject at this level
    missing: list[str]  # supported classes this job has not met yet (run a drill plan)
    uncovered: list[ReportUncovered]
    recovery: ReportRecovery
    lost: ReportLost
    saves: ReportSaves
    goodput: dict[str, float]
    at_scale: ReportAtScale | None  # None until the job has a step time
    links: dict[str, str]


def nearest_rank(values: list[float], p: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


def percentiles(values: list[float]) -> ReportPercentiles:
    return ReportPercentiles(n=len(values), p50_s=nearest_rank(values, 50), p95_s=nearest_rank(values, 95))


def level_of(job: Job) -> int:
    """The job's integration level: the ranks' report, else its spec (own script without in-process: 0)."""
    reported = readouts.integration(job)
    if reported is not None and reported.level is not None:
        return reported.level
    spec = job.spec or {}
    return 2 if not spec.get("entrypoint") or spec.get("in_process") else 0


def _api(job: Job, tail: str = "") -> str:
    return reverse("api:job", args=[job.pk]) + tail


# The report as one self-contained HTML file is the dashboard's to draw (its templates and charts); the API
# serves it through this port, which the dashboard fills in its ``AppConfig.ready`` (the API cannot import
# the dashboard: they are sibling faces over the domain).
_html_renderer: Callable[[Report, str], str] | None = None


def serve_html(renderer: Callable[[Report, str], str]) -> None:
    global _html_renderer
    _html_renderer = renderer


def as_html(r: Report, *, base_url: str = "") -> str:
    """The report as one HTML file (plotly, CSS and script inlined: no request leaves it)."""
    if _html_renderer is None:
        raise LookupError("the report's HTML is drawn by controlplane.dashboard, which is not installed")
    return _html_renderer(r, base_url)


def build_report(job: Job, *, now: datetime | None = None, gpus: int = projection.LLAMA3.gpus,
                 rate: projection.FailureRate = projection.LLAMA3) -> Report:
    now = now or timezone.now()
    level = level_of(job)
    cycles = list(RestartCycle.objects.filter(job=job).order_by("fault_at", "id"))
    by_key = {c.key: c for c in cycles}
    faults = list(Fault.objects.filter(job=job).select_related("cycle").order_by("at", "id"))
    first_fault = dict(Fault.objects.filter(job=job, cycle__isnull=False).values_list("cycle_id")
                       .annotate(first=Min("id")).order_by())
    primary_of = {f.cycle_id: f for f in faults if first_fault.get(f.cycle_id) == f.pk}
    recovery = _recovery(job, cycles)
    classes = _classes(job, cycles, by_key, faults, primary_of)
    supported = [str(c) for c in (LEVEL2_CLASSES if level >= 2 else LEVEL0_CLASSES)]
    met = {r.fault_class for r in classes if r.cycles}
    saves = _saves(job)
    g = job.goodput(now)
    return Report(
        job=job.pk, name=job.name, status=job.status, level=level, generated_at=now, classes=classes,
        supported=supported, missing=[c for c in supported if _met_name(c) not in met],
        uncovered=[ReportUncovered(fault_class=c, why=w, sdk=s) for c, w, s in NOT_AT_LEVEL0]
        if level < 2 else [],
        recovery=recovery, lost=_lost(job, cycles), saves=saves, goodput=g,
        at_scale=_at_scale(job, cycles, saves, g, gpus=gpus, rate=rate),
        links={"job": _api(job), "page": reverse("dashboard:job", args=[job.pk]),
               "cycles": _api(job, "/cycles"), "faults": _api(job, "/faults"),
               "checkpoints": _api(job, "/checkpoints"),
               "goodput": _api(job, "/goodput"), "report": _api(job, "/report")},
    )


def _met_name(supported: str) -> str:
    # A drill's sigkill is recorded as process_killed; a hang in a collective as a hang.
    return {"hang_collective": FaultClass.HANG, "killed_during_save": FaultClass.PROCESS_KILLED}.get(
        supported, supported)


def _final(c: RestartCycle, by_key: dict[str, RestartCycle]) -> RestartCycle:
    """The cycle that finished an escalation (``escalated_to`` chain), else ``c``."""
    seen = set()
    while c.escalated_to and c.escalated_to in by_key and c.key not in seen:
        seen.add(c.key)
        c = by_key[c.escalated_to]
    return c


def _classes(job, cycles, by_key, faults, primary_of) -> list[ReportClass]:
    per: dict[str, dict] = defaultdict(lambda: {"faults": [], "cycles": []})
    for f in faults:
        per[f.fault_class]["faults"].append(f)
    escalated_into = {c.escalated_to for c in cycles if c.escalated_to}
    for c in cycles:
        if c.key in escalated_into:
            continue  # counted with the cycle it finished
        f = primary_of.get(c.pk)
        per[f.fault_class if f is not None else OPERATOR]["cycles"].append(c)
    rows = []
    for name in sorted(per, key=lambda n: (n == OPERATOR, n)):
        fs, cs = per[name]["faults"], per[name]["cycles"]
        layers: dict[str, int] = defaultdict(int)
        recovered = open_ = failed = 0
        for c in cs:
            end = _final(c, by_key)
            layers[end.layer] += 1
            if end.layer == Layer.NONE and end.first_step_at is None:
                failed += 1
            elif end.first_step_at is None:
                open_ += 1
            else:
                recovered += 1
        failed += sum(1 for f in fs if f.cycle_id is None)
        rows.append(ReportClass(
            fault_class=name, faults=len(fs), cycles=[c.key for c in cs], layers=dict(layers),
            recovered=recovered, open=open_, not_recovered=failed,
            detection=percentiles([c.detection_s for c in cs if c.detection_s is not None]),
            recovery=percentiles([c.recovery_s for c in cs if c.recovery_s is not None]),
            fault_ids=[f.pk for f in fs],
            links={"faults": _api(job, f"/faults?fault_class={name}") if name != OPERATOR else "",
                   "cycles": _api(job, "/cycles")},
        ))
    return rows


def _recovery(job, cycles: list[RestartCycle]) -> ReportRecovery:
    phase_values: dict[str, list[float]] = defaultdict(list)
    reload_s = total_s = 0.0
    for c in cycles:
        d = c.durations()
        for name in PHASES:
            if d.get(name) is not None:
                phase_values[name].append(d[name])
        if d.get("reload") is not None and c.recovery_s:
            reload_s += d["reload"]
            total_s += c.recovery_s
    phases = [ReportPhase(name=n, n=len(v), p50_s=nearest_rank(v, 50), p95_s=nearest_rank(v, 95),
                          total_s=sum(v)) for n in PHASES if (v := phase_values[n])]
    by_layer = []
    for layer in (Layer.IN_PROCESS, Layer.IN_JOB, Layer.JOB, Layer.NONE):
        mine = [c for c in cycles if c.layer == layer]
        if mine:
            rec = [c.recovery_s for c in mine if c.recovery_s is not None]
            by_layer.append(ReportLayer(layer=layer, cycles=[c.key for c in mine], recovery=percentiles(rec),
                                     mean_recovery_s=statistics.fmean(rec) if rec else None))
    return ReportRecovery(
        detection=percentiles([c.detection_s for c in cycles if c.detection_s is not None]),
        recovery=percentiles([c.recovery_s for c in cycles if c.recovery_s is not None]),
        phases=phases, reload_share=(reload_s / total_s) if total_s > 0 else None, by_layer=by_layer,
        cycles=[c.key for c in cycles], links={"cycles": _api(job, "/cycles")},
    )


def _lost(job, cycles) -> ReportLost:
    interval = int((job.spec or {}).get("checkpoint_interval") or 1)
    rows = [ReportLostRow(cycle=c.key, layer=c.layer, step_at_fault=c.step_at_fault,
                    resumed_from_step=c.resumed_from_step, lost_steps=c.lost_steps) for c in cycles]
    known = [r.lost_steps for r in rows if r.lost_steps is not None]
    return ReportLost(interval_steps=interval, rows=rows, mean=statistics.fmean(known) if known else None,
                max=max(known) if known else None,
                beyond_interval=[r.cycle for r in rows if (r.lost_steps or 0) > 2 * interval])


def _saves(job) -> ReportSaves:
    rows, costs = [], {CheckpointMode.ASYNC: [], CheckpointMode.SYNC: []}
    advice_rows = []
    for c in Checkpoint.objects.filter(job=job).order_by("started_at", "id"):
        blocking = c.blocking_s
        if blocking is None and c.mode == CheckpointMode.SYNC and c.finished_at is not None:
            blocking = (c.finished_at - c.started_at).total_seconds()  # goodput's rule: a sync save blocks
        cost = (None if blocking is None and c.interference_s is None
                else (blocking or 0) + (c.interference_s or 0))
        rows.append(ReportSave(id=c.pk, step=c.step, mode=c.mode, state=c.state, blocking_s=blocking,
                            interference_s=c.interference_s, cost_s=cost))
        if c.state == CheckpointState.DURABLE and cost is not None and c.mode in costs:
            costs[c.mode].append(cost)
        advice_rows.append((c.mode, c.state, c.blocking_s, c.write_s, c.interference_s))
    advice = readouts.checkpoint_mode_advice(advice_rows)
    mine = costs.get((job.spec or {}).get("checkpoint_mode", "async")) or costs[CheckpointMode.ASYNC] or \
        costs[CheckpointMode.SYNC]
    return ReportSaves(rows=rows, async_cost=percentiles(costs[CheckpointMode.ASYNC]),
                 sync_cost=percentiles(costs[CheckpointMode.SYNC]),
                 cheaper=advice.cheaper if advice else None,
                 save_cost_s=statistics.median(mine) if mine else None,
                 links={"checkpoints": _api(job, "/checkpoints")})


def step_time(job: Job) -> float | None:
    samples = TrainingSample.objects.filter(job=job, step_time_s__gt=0)
    times = list(samples.order_by("-at").values_list("step_time_s", flat=True)[:2000])
    if not times:
        times = list(job.ranks.filter(step_time_s__gt=0).values_list("step_time_s", flat=True))
    return statistics.median(times) if times else None


def _at_scale(job, cycles, saves: ReportSaves, g: dict, *, gpus: int,
              rate: projection.FailureRate) -> ReportAtScale | None:
    step = step_time(job)
    if step is None:
        return None
    by_key = {c.key: c for c in cycles}
    escalated_into = {c.escalated_to for c in cycles if c.escalated_to}
    # A fault's whole cost under the job's layers: first mark to first step of the cycle that finished it.
    mine = []
    for c in cycles:
        if c.key in escalated_into or c.command_id is not None:
            continue
        end = _final(c, by_key)
        if end.first_step_at is not None and c.start_at is not None:
            mine.append(max(0.0, (end.first_step_at - c.start_at).total_seconds()))
    job_level = [c.recovery_s for c in cycles if c.layer == Layer.JOB and c.recovery_s is not None]
    scenarios = {}
    sources = {}
    if mine:
        scenarios["with this job's layers"] = statistics.fmean(mine)
        sources["with this job's layers"] = f"mean of this job's {len(mine)} recoveries"
    aws_job = projection.AWS_RECIPE[-1].recovery_s
    if job_level:
        scenarios["job-level restarts only"] = statistics.fmean(job_level)
        sources["job-level restarts only"] = f"mean of this job's {len(job_level)} job-level restarts"
    else:
        scenarios["job-level restarts only"] = aws_job
        sources["job-level restarts only"] = ("assumed: AWS's published plain Kubernetes restart (this job "
                                              "has no job-level restart to measure)")
    save_cost = saves.save_cost_s or 0.0
    interval = int((job.spec or {}).get("checkpoint_interval") or 1)
    p = projection.project(gpus=gpus, rate=rate, step_time_s=step, interval_steps=interval,
                           save_cost_s=save_cost, recoveries=scenarios)
    return ReportAtScale(
        gpus=gpus, interruptions=rate.interruptions, days=rate.days, on_gpus=rate.gpus,
        rate_source=rate.source, rate_url=rate.url, mtbf_s=p.mtbf_s, step_time_s=step,
        interval_steps=interval, interval_s=p.interval_s,
        save_cost_s=save_cost,
        scenarios=[ReportScenario(name=s.name, recovery_s=s.recovery_s, recovery_source=sources[s.name],
                            goodput_now=s.goodput_now, best_interval_s=s.best_interval_s,
                            best_interval_steps=s.best_interval_steps, goodput_best=s.goodput_best)
                   for s in p.scenarios],
        caveats=list(p.caveats),
        published=[ReportPublished(layer=r.layer, recovery_s=r.recovery_s, goodput_pct=r.goodput_pct)
                   for r in projection.AWS_RECIPE],
        published_source=projection.AWS_RECIPE_SOURCE,
    )
