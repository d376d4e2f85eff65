"""Pages, fragments and the live cursor endpoints. Views parse, authorise, call, render.

Live updates are cursor polling (``*_live``): the page sends the signatures it holds, the server
answers with the names of parts that changed (usually none: a few bytes), and the page fetches
just those fragments. Each poll is one short request, so no DB connection is held between polls,
and it works the same under WSGI (runserver, gunicorn) and ASGI (uvicorn), on SQLite and Postgres.
"""

from __future__ import annotations

from datetime import timedelta

from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.http import Http404, JsonResponse
from django.shortcuts import get_object_or_404, render
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from controlplane.dashboard import fleet
from controlplane.dashboard.assets import PLOTLY_VERSION
from controlplane.dashboard.code import code_part
from controlplane.dashboard.parts import (
    checkpoint_part,
    fault_table,
    goodput_part,
    job_list,
    progress_part,
    rank_table,
    records,
    signatures,
    timeline_part,
)
from controlplane.dashboard.words import fmt_s, recovery_words
from controlplane.jobs import readouts
from controlplane.jobs.models import Job
from controlplane.jobs.roles import is_operator
from controlplane.jobs.versions import runtime_versions
from trainer.wire import DrillFault, Layer

JOBS_PER_PAGE = 25


def _jobs_page(request):
    return Paginator(Job.objects.order_by("-id"), JOBS_PER_PAGE).get_page(request.GET.get("page"))


def _jobs_context(request, now):
    page = _jobs_page(request)
    jobs = list(page.object_list)
    return {
        "page": page,
        "rows": job_list.job_rows(jobs, now),
        "cursor": signatures.jobs_signature(jobs),
        "now": now,
    }


@login_required
@require_GET
def jobs(request):
    now = timezone.now()
    return render(
        request,
        "dashboard/jobs.html",
        {**_jobs_context(request, now), "is_operator": is_operator(request.user)},
    )


@login_required
@require_GET
@never_cache
def jobs_table(request):
    return render(request, "dashboard/parts/jobs_table.html", _jobs_context(request, timezone.now()))


@login_required
@require_GET
@never_cache
def jobs_live(request):
    jobs_ = list(_jobs_page(request).object_list)
    cursor = signatures.jobs_signature(jobs_)
    return JsonResponse({"cursor": cursor, "changed": ["table"] if cursor != request.GET.get("c") else []})


def part_context(name: str, job: Job, request, now) -> dict:
    """The context of one part of the job page (the page includes every part; fragments one)."""
    if name == "header":
        return {"code": code_part(job), "ran_with": runtime_versions(job), "step": readouts.step_shown(job)}
    if name == "actions":
        return {}
    if name == "timeline":
        follow = request.GET.get("follow", "1" if job.is_active else "0") == "1"
        start, end = _float(request.GET.get("start")), _float(request.GET.get("end"))
        return {
            "timeline": timeline_part.timeline_part(
                job,
                now,
                start=start / 1000 if start else None,
                end=end / 1000 if end else None,
                follow=follow,
                node=(request.GET.get("node") or "").strip() or None,
            )
        }
    if name == "checkpoints":
        return {"ckpt": checkpoint_part.checkpoint_part(job)}
    if name == "faults":
        return {"faults": fault_table.faults_part(job, request.GET)}
    if name == "goodput":
        return {"goodput": goodput_part.goodput_part(job, now)}
    if name == "ranks":
        return {"ranks": rank_table.ranks_part(job, now, request.GET)}
    if name == "progress":
        return {"progress": progress_part.progress_part(job, now)}
    if name == "commands":
        return records.commands_part(job)
    if name == "audit":
        return records.audit_part(job)
    if name == "log":
        return {"log": records.log_part(job)}
    raise Http404(f"no part {name!r}; parts: {', '.join(signatures.JOB_SECTIONS)}")


def _float(v):
    try:
        return float(v) if v not in (None, "") else None
    except ValueError:
        return None


def _base_context(job, request, now) -> dict:
    return {
        "job": job,
        "now": now,
        "is_operator": is_operator(request.user),
        "plotly_version": PLOTLY_VERSION,
        "max_rank_lanes": fleet.MAX_RANK_LANES,
        "layers": [(v.value, v.value.replace("_", "-")) for v in Layer if v != Layer.NONE],
        "drill_faults": [f.value for f in DrillFault],
        # A large job's rank is typed (a number field), not picked from 100,000 options.
        "rank_ids": None if fleet.is_large(job) else range(job.world_size),
    }


@login_required
@require_GET
def job_detail(request, job_id: int):
    job = get_object_or_404(Job, pk=job_id)
    now = timezone.now()
    ctx = _base_context(job, request, now)
    for name in signatures.JOB_SECTIONS:
        ctx.update(part_context(name, job, request, now))
    sigs = signatures.job_signatures(job, now)
    ctx["cursor"] = ".".join(sigs[n] for n in signatures.JOB_SECTIONS)
    ctx["live_config"] = {
        "live": _url("dashboard:job_live", job.pk),
        "part": _url("dashboard:job_part", job.pk, "x"),
        "cursor": ctx["cursor"],
        "interval_ms": 500,
        "sections": list(signatures.JOB_SECTIONS),
    }
    return render(request, "dashboard/job.html", ctx)


def _url(name, *args):
    from django.urls import reverse

    return reverse(name, args=args)


@login_required
@require_GET
@never_cache
def job_part(request, job_id: int, name: str):
    if name not in signatures.JOB_SECTIONS:
        raise Http404(f"no part {name!r}")
    job = get_object_or_404(Job, pk=job_id)
    now = timezone.now()
    ctx = {**_base_context(job, request, now), **part_context(name, job, request, now)}
    return render(request, f"dashboard/parts/{name}.html", ctx)


@login_required
@require_GET
@never_cache
def job_live(request, job_id: int):
    """Which parts changed since the cursor ``c`` (dot-joined signatures in JOB_SECTIONS order)."""
    job = get_object_or_404(Job, pk=job_id)
    now = timezone.now()
    sigs = signatures.job_signatures(job, now)
    old = (request.GET.get("c") or "").split(".")
    changed = [n for i, n in enumerate(signatures.JOB_SECTIONS) if i >= len(old) or old[i] != sigs[n]]
    return JsonResponse(
        {
            "cursor": ".".join(sigs[n] for n in signatures.JOB_SECTIONS),
            "changed": changed,
            "server_ms": int(now.timestamp() * 1000),
        }
    )


@login_required
@require_GET
def fault_detail(request, job_id: int, fault_id: int):
    """One fault: its summary sentence and everything that proves it (``jobs/evidence.py``)."""
    from controlplane.jobs import evidence, readouts
    from controlplane.jobs.models import Fault
    from controlplane.launchers.logs import fault_log

    job = get_object_or_404(Job, pk=job_id)
    fault = get_object_or_404(Fault.objects.select_related("cycle"), job=job, pk=fault_id)
    tail = fault_log(job, fault)
    nodes, ended = job.rank_nodes(), not job.is_active
    ev = evidence.fault_evidence(fault, log_text=tail.text, log_why=tail.why, rank_nodes=nodes, ended=ended)
    # Detection, recovery and steps lost: the figures the fault table and the timeline's hovers show.
    fig = readouts.fault_figures(fault, rank_nodes=nodes, ended=ended)
    return render(request, "dashboard/fault.html", {
        "job": job, "f": fault, "ev": ev, "fig": fig,
        "detected_at": fault.at + timedelta(seconds=fig.detection_s),
        "detection": fmt_s(fig.detection_s),
        "recovery": recovery_words(fig)})
