"""The operator API: start, inspect, restart, stop jobs from scripts and CI.

Reading needs any account; acting needs an operator (``controlplane.api.http``). Every action is
audited by the service it calls. A job's lists (ranks, faults, cycles, checkpoints, commands) come a
page at a time in a stable order with a ``next`` link, filtered by the query parameters their
``*Query`` type declares; their figures are the job page's (``controlplane.api.render``). The
OpenAPI document is generated from the same types (``controlplane.api.openapi``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import TypeVar

from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.csrf import csrf_exempt

from controlplane.api import openapi as doc
from controlplane.api import render, schema
from controlplane.api.http import (
    Refused,
    authorise,
    body,
    error,
    job_or_404,
    keyset,
    next_link,
    query,
    respond,
)
from controlplane.api.report_schema import Check, CheckCreate, CheckDrill, ReportQuery
from controlplane.jobs import drill_plan, evidence, readouts, resilience_report, services
from controlplane.jobs.models import (
    AuditEntry,
    Checkpoint,
    Command,
    Fault,
    Job,
    QuarantinedHeartbeat,
    Rank,
    RestartCycle,
    TrainingSample,
)
from controlplane.jobs.spec import JobSpec, SpecError
from controlplane.launchers import services as launch_services
from controlplane.launchers.logs import fault_log, log_tail
from trainer.wire import CommandKind


def api_view(*methods: str) -> Callable:
    """JSON errors for refusals and other methods (405 with Allow); never cached; CSRF checked by
    ``authorise`` for session writes (Basic-authenticated scripts have no CSRF token)."""

    def deco(fn):
        @csrf_exempt
        @never_cache
        @wraps(fn)
        def view(request: HttpRequest, *args, **kwargs) -> HttpResponse:
            if request.method not in methods:
                resp = error(405, f"use {' or '.join(methods)}")
                resp["Allow"] = ", ".join(methods)
                return resp
            try:
                return fn(request, *args, **kwargs)
            except Refused as r:
                return r.response

        return view

    return deco


T = TypeVar("T")


def _job_read(request: HttpRequest, job_id: int, type_: type[T]) -> tuple[Job, T]:
    """The start of every read of one job's rows: the reader authorised (401/403), then the job found (404),
    then the query string parsed (422), in that order (no 404 or 422 before credentials are checked)."""
    authorise(request, act=False)
    return job_or_404(job_id), query(request, type_)


def _page(request: HttpRequest, q: schema.Page, qs, render_row: Callable, **order) -> tuple[list, str | None]:
    """One page of ``qs`` rendered row by row, and the link to the next page (None on the last)."""
    rows, after = keyset(qs, q, **order)
    return [render_row(r) for r in rows], next_link(request, q, after)


@api_view("GET", "POST")
def jobs(request: HttpRequest) -> HttpResponse:
    """GET: jobs, newest first. POST: start a job (operators)."""
    if request.method == "POST":
        return _create_job(request)
    authorise(request, act=False)
    q = query(request, schema.JobsQuery)
    qs = Job.objects.all()
    if q.status:
        qs = qs.filter(status=q.status)
    listed, next_page = _page(request, q, qs, render.job, descending=True)
    return respond(schema.JobList(jobs=listed, next=next_page))


def _create_job(request: HttpRequest) -> HttpResponse:
    user = authorise(request, act=True)
    data = body(request, schema.JobCreate)
    try:
        spec = JobSpec.from_dict(data.spec)
    except SpecError as e:
        return error(422, str(e), fields=e.errors)
    problems = launch_services.preflight(spec=spec)
    if problems:
        named = {p.split(" ", 1)[0]: p for p in problems
                 if p.split(" ", 1)[0] in ("entrypoint", "working_dir")}
        return error(422, "cannot launch: " + "; ".join(problems), preflight=problems,
                     field=next(iter(named), None), fields=named or None)
    job = services.create_job(name=data.name, spec=spec, created_by=user,
                              remote_addr=request.META.get("REMOTE_ADDR"),
                              notify_webhook_url=data.notify_webhook_url, notify_email=data.notify_email)
    return respond(render.job(job), 201)


@api_view("GET")
def job_detail(request: HttpRequest, job_id: int) -> HttpResponse:
    """The job with a summary of everything its page shows, and links to each list."""
    authorise(request, act=False)
    query(request, schema.NoQuery)
    return respond(render.job_detail(job_or_404(job_id), timezone.now()))


@api_view("GET")
def job_goodput(request: HttpRequest, job_id: int) -> HttpResponse:
    authorise(request, act=False)
    query(request, schema.NoQuery)
    return respond(render.goodput(job_or_404(job_id), timezone.now()))


@api_view("GET")
def job_report(request: HttpRequest, job_id: int) -> HttpResponse:
    """The job's resilience report (``jobs/resilience_report.py``): the page's and the HTML file's figures."""
    authorise(request, act=False)
    q = query(request, ReportQuery)
    report = resilience_report.build_report(job_or_404(job_id), gpus=q.gpus, rate=q.rate())
    if q.format == "html":
        out = HttpResponse(resilience_report.as_html(report, base_url=request.build_absolute_uri("/").rstrip("/")),
                           content_type="text/html; charset=utf-8")
        out["Content-Disposition"] = f'attachment; filename="job-{job_id}-report.html"'
        return out
    return respond(report)


@api_view("POST")
def job_checks(request: HttpRequest, job_id: int) -> HttpResponse:
    """Start a resilience check of the job (operators): its spec with a drill plan (``jobs.drill_plan``)."""
    user = authorise(request, act=True)
    job = job_or_404(job_id)
    data = body(request, CheckCreate)
    try:
        spec = job.job_spec
    except SpecError as e:
        return error(409, f"this job's stored spec no longer validates, so it cannot be run again: {e}")
    default = drill_plan.default_plan(spec)
    plan = drill_plan.Plan(faults=tuple(data.faults or default.faults),
                           placements=tuple(data.placements or default.placements),
                           ranks=tuple(data.ranks or default.ranks), repeats=data.repeats)
    try:
        run_spec = drill_plan.plan_spec(spec, plan)
        est = drill_plan.budget(job, spec, plan)
    except drill_plan.PlanError as e:
        return error(422, str(e), fields=e.errors)
    run = None
    if not data.dry_run:
        problems = launch_services.preflight(spec=run_spec)
        if problems:
            return error(422, "cannot launch: " + "; ".join(problems), preflight=problems)
        run = drill_plan.start_resilience_check(job=job, plan=plan, requested_by=user,
                                                remote_addr=request.META.get("REMOTE_ADDR"))
    return respond(Check(**plan.to_dict(), steps=est.steps, budget_s=est.total_s,
                         drills=[CheckDrill(step=d.step, fault=d.fault, rank=d.rank)
                                 for d in run_spec.drills],
                         run=run.pk if run else None, run_url=render.links(run).self if run else None),
                   201 if run else 200)


@api_view("GET")
def job_ranks(request: HttpRequest, job_id: int) -> HttpResponse:
    """Every rank of the job's world by rank number (ranks that never reported: health "unknown")."""
    job, q = _job_read(request, job_id, schema.RanksQuery)
    now = timezone.now()
    rows = Rank.objects.filter(job=job)
    if q.node is not None:
        rows = rows.filter(node=q.node)
    world = readouts.world(job, rows) if q.node is None else list(rows.order_by("rank"))
    if q.after is not None:
        world = [r for r in world if (r.rank if isinstance(r, Rank) else r[0]) > q.after]
    out: list[schema.Rank] = []
    after = None
    # Health depends on now, so it is filtered here; figures are computed a page's worth at a time.
    for i in range(0, len(world), q.limit):
        chunk = [f for f in readouts.rank_figures(job, world[i:i + q.limit], now)
                 if q.health is None or f.health == q.health]
        out += [render.rank(f, now) for f in chunk]
        if len(out) >= q.limit:
            more = len(out) > q.limit or i + q.limit < len(world)
            out = out[: q.limit]
            after = out[-1].rank if more else None
            break
    return respond(schema.RankList(ranks=out, next=next_link(request, q, after)))


@api_view("GET")
def job_faults(request: HttpRequest, job_id: int) -> HttpResponse:
    """Faults in the order they were recorded, with their evidence and their cycle's figures."""
    job, q = _job_read(request, job_id, schema.FaultsQuery)
    qs = Fault.objects.filter(job=job).select_related("cycle")
    if q.fault_class:
        qs = qs.filter(fault_class=q.fault_class)
    if q.layer:
        qs = qs.filter(cycle__layer=q.layer)
    if q.rank is not None:
        qs = qs.filter(rank=q.rank)
    nodes = job.rank_nodes()
    faults, next_page = _page(request, q, qs, lambda f: render.fault(f, nodes, ended=not job.is_active))
    return respond(schema.FaultList(faults=faults, next=next_page))


@api_view("GET")
def job_fault(request: HttpRequest, job_id: int, fault_id: int) -> HttpResponse:
    """One fault with its evidence and summary sentence (``jobs/evidence.py``)."""
    authorise(request, act=False)
    job = job_or_404(job_id)
    query(request, schema.NoQuery)
    f = Fault.objects.filter(job=job, pk=fault_id).select_related("cycle").first()
    if f is None:
        raise Refused(404, f"job {job.pk} has no fault {fault_id}")
    nodes = job.rank_nodes()
    tail = fault_log(job, f)
    ended = not job.is_active
    ev = evidence.fault_evidence(f, log_text=tail.text, log_why=tail.why, rank_nodes=nodes, ended=ended)
    return respond(schema.FaultDetail(fault=render.fault(f, nodes, ended=ended, summary=ev.summary),
                                      evidence=render.evidence(ev)))


@api_view("GET")
def job_cycles(request: HttpRequest, job_id: int) -> HttpResponse:
    """Restart cycles in the order they were opened, with their marks and the time between them."""
    job, q = _job_read(request, job_id, schema.CyclesQuery)
    qs = RestartCycle.objects.filter(job=job)
    if q.layer:
        qs = qs.filter(layer=q.layer)
    if q.open is not None:
        qs = qs.filter(first_step_at__isnull=q.open)
    cycles, next_page = _page(request, q, qs, render.cycle)
    return respond(schema.CycleList(cycles=cycles, next=next_page))


@api_view("GET")
def job_checkpoints(request: HttpRequest, job_id: int) -> HttpResponse:
    """The checkpoint ledger in the order saves were recorded (every attempt of a step is its own row)."""
    job, q = _job_read(request, job_id, schema.CheckpointsQuery)
    qs = Checkpoint.objects.filter(job=job)
    if q.state:
        qs = qs.filter(state=q.state)
    if q.mode:
        qs = qs.filter(mode=q.mode)
    checkpoints, next_page = _page(request, q, qs, render.checkpoint)
    return respond(schema.CheckpointList(checkpoints=checkpoints, next=next_page))


@api_view("GET", "POST")
def job_commands(request: HttpRequest, job_id: int) -> HttpResponse:
    """GET: commands in the order they were issued. POST: issue one (operators)."""
    if request.method == "POST":
        return _issue_command(request, job_id)
    job, q = _job_read(request, job_id, schema.CommandsQuery)
    qs = Command.objects.filter(job=job).select_related("issued_by")
    if q.kind:
        qs = qs.filter(kind=q.kind)
    if q.status:
        qs = qs.filter(status=q.status)
    commands, next_page = _page(request, q, qs, render.command)
    return respond(schema.CommandList(commands=commands, next=next_page))


@api_view("GET")
def job_samples(request: HttpRequest, job_id: int) -> HttpResponse:
    """The loss and throughput history in the order stored (sort by ``at`` to chart it)."""
    job, q = _job_read(request, job_id, schema.SamplesQuery)
    qs = TrainingSample.objects.filter(job=job)
    if q.rank is not None:
        qs = qs.filter(rank=q.rank)
    samples, next_page = _page(request, q, qs, render.sample)
    return respond(schema.SampleList(samples=samples, next=next_page))


@api_view("GET")
def job_audit(request: HttpRequest, job_id: int) -> HttpResponse:
    """Who did what to the job, newest first (as on the page)."""
    job, q = _job_read(request, job_id, schema.Page)
    audit, next_page = _page(request, q, AuditEntry.objects.filter(job=job), render.audit, descending=True)
    return respond(schema.AuditList(audit=audit, next=next_page))


@api_view("GET")
def job_quarantined(request: HttpRequest, job_id: int) -> HttpResponse:
    """Heartbeat state the flush could not store (the page's "Quarantined heartbeats"), by rank row."""
    job, q = _job_read(request, job_id, schema.Page)
    items, next_page = _page(request, q, QuarantinedHeartbeat.objects.filter(job=job), render.quarantined)
    return respond(schema.QuarantinedList(quarantined=items, next=next_page))


@api_view("GET")
def job_log(request: HttpRequest, job_id: int) -> HttpResponse:
    authorise(request, act=False)
    query(request, schema.NoQuery)
    tail = log_tail(job_or_404(job_id))
    return respond(schema.Log(text=tail.text, why=tail.why))


def _issue_command(request: HttpRequest, job_id: int) -> HttpResponse:
    user = authorise(request, act=True)
    job = job_or_404(job_id)
    data = body(request, schema.CommandCreate)
    addr = request.META.get("REMOTE_ADDR")
    try:
        if data.kind == CommandKind.STOP:
            cmd = services.stop_job(job=job, requested_by=user, remote_addr=addr)
        elif data.kind == CommandKind.RESTART:
            if data.level is None:
                return error(422, "restart needs the level to restart at", field="level")
            cmd = services.restart_job(job=job, level=data.level, rank=data.rank, requested_by=user,
                                       remote_addr=addr)
        else:
            if data.rank is None:
                return error(422, "inject_fault needs the rank to inject into", field="rank")
            if data.fault is None:
                return error(422, "inject_fault needs the fault to inject", field="fault")
            cmd = services.inject_fault(job=job, fault=data.fault, rank=data.rank, requested_by=user,
                                        remote_addr=addr)
    except services.ActionError as e:
        return error(409, str(e))
    return respond(render.command(cmd), 202)


@never_cache
def openapi(request: HttpRequest) -> HttpResponse:
    """The operator API's OpenAPI document (public: it holds no data)."""
    return HttpResponse(doc.document_bytes(), content_type="application/json")
