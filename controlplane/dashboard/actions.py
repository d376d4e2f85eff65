"""Operator actions: start, stop, restart, inject. POST forms with CSRF, each confirmed first.

Confirmation works without JavaScript: a POST without ``confirmed=yes`` renders a confirmation page
that re-posts the same fields with ``confirmed=yes``. With JavaScript, a dialog asks first and
submits with ``confirmed=yes`` directly. The services write the Command and its AuditEntry.
Anonymous users are sent to the login page; signed-in viewers get 403.
"""

from __future__ import annotations

from functools import wraps

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.http import require_http_methods, require_POST

from controlplane.dashboard.forms import PRESET_CHOICES, JobForm
from controlplane.jobs import services
from controlplane.jobs.models import Job
from controlplane.jobs.roles import is_operator
from controlplane.jobs.spec import JobSpec
from controlplane.launchers import services as launch_services


def operator_required(view):
    @wraps(view)
    def wrapped(request, *args, **kwargs):
        if not is_operator(request.user):
            raise PermissionDenied(
                "only operators can do this; ask an admin to add you to the 'operators' group"
            )
        return view(request, *args, **kwargs)

    return login_required(wrapped)


def _remote_addr(request) -> str | None:
    return request.META.get("REMOTE_ADDR") or None


def _confirmed(request) -> bool:
    return request.POST.get("confirmed") == "yes"


def _confirm(request, *, title: str, message: str, job: Job | None, danger: bool = False):
    fields = [(k, v) for k, v in request.POST.items() if k not in ("csrfmiddlewaretoken", "confirmed")]
    back = reverse("dashboard:job", args=[job.pk]) if job else reverse("dashboard:jobs")
    return render(
        request,
        "dashboard/confirm.html",
        {
            "title": title,
            "message": message,
            "fields": fields,
            "action": request.path,
            "back": back,
            "danger": danger,
        },
    )


def _back(request, job: Job, error: services.ActionError):
    """Back to the job's page, saying why the action was refused."""
    messages.error(request, str(error))
    return redirect("dashboard:job", job_id=job.pk)


def _done(request, job: Job, action, ok: str, **args):
    """Do ``action`` (a ``services`` call) on ``job`` as the requesting operator, then back to the job's
    page with ``ok`` or the reason it was refused."""
    try:
        action(job=job, requested_by=request.user, remote_addr=_remote_addr(request), **args)
    except services.ActionError as e:
        return _back(request, job, e)
    messages.success(request, ok)
    return redirect("dashboard:job", job_id=job.pk)


def _rank(request, job: Job, *, required: bool) -> int | None:
    raw = request.POST.get("rank", "")
    if raw == "" and not required:
        return None
    try:
        return int(raw)
    except ValueError:
        raise services.ActionError(f"choose a rank 0..{job.world_size - 1}") from None


@require_POST
@operator_required
def job_stop(request, job_id: int):
    job = get_object_or_404(Job, pk=job_id)
    if not _confirmed(request):
        return _confirm(
            request,
            job=job,
            danger=True,
            title=f"Stop job #{job.pk}?",
            message=("The trainer saves a final checkpoint and exits; anything left after the grace "
                     "period is killed." if services.stop_grace_s(job) else
                     "This script does not use the SDK, so it cannot save on a stop: its processes are "
                     "terminated now."),
        )
    return _done(request, job, services.stop_job, f"Stop requested for job #{job.pk}.")


@require_POST
@operator_required
def job_restart(request, job_id: int):
    job = get_object_or_404(Job, pk=job_id)
    level = request.POST.get("level", "")
    try:
        rank = _rank(request, job, required=False)
    except services.ActionError as e:
        return _back(request, job, e)
    what = {
        "in_process": "in-process (same processes, NVRx Wrapper)",
        "in_job": "in-job (ft_launcher restarts the worker group)",
        "job": "the whole job (new processes or pods)",
    }.get(level, level)
    if not _confirmed(request):
        return _confirm(
            request,
            job=job,
            danger=level == "job",
            title=f"Restart job #{job.pk}: {what}?",
            message="Training rolls back to the newest durable checkpoint; steps after it are recomputed.",
        )
    return _done(request, job, services.restart_job, f"Restart ({what}) requested.", level=level, rank=rank)


@require_POST
@operator_required
def job_inject(request, job_id: int):
    job = get_object_or_404(Job, pk=job_id)
    fault = request.POST.get("fault", "")
    try:
        rank = _rank(request, job, required=True)
    except services.ActionError as e:
        return _back(request, job, e)
    if not _confirmed(request):
        return _confirm(
            request,
            job=job,
            danger=True,
            title=f"Inject {fault} into rank {rank} of job #{job.pk}?",
            message="A fault drill: the trainer raises, hangs or dies on purpose, and the resilience "
            "layers must recover it.",
        )
    return _done(request, job, services.inject_fault, f"Fault {fault} sent to rank {rank}.",
                 fault=fault, rank=rank)


def _job_to_repeat(request) -> Job | None:
    raw = request.GET.get("from", "")
    if not raw.isdigit():
        return None
    return get_object_or_404(Job, pk=int(raw))


@require_http_methods(["GET", "POST"])
@operator_required
def job_new(request):
    presets = [{"key": k, "label": v[0], "help": v[1]} for k, v in PRESET_CHOICES.items()]
    if request.method == "GET":
        again = _job_to_repeat(request)
        if again is not None:  # "start again with this spec": the finished job's spec, to check and start
            form = JobForm(initial=JobForm.initial_for(again.job_spec, name=again.name))
            return render(request, "dashboard/job_new.html",
                          {"form": form, "presets": presets, "preset": "", "again": again})
        key = request.GET.get("preset", "demo")
        label, _, spec = PRESET_CHOICES.get(key, PRESET_CHOICES["demo"])
        form = JobForm(initial=JobForm.initial_for(spec, name=key if key in PRESET_CHOICES else "demo"))
        return render(request, "dashboard/job_new.html", {"form": form, "presets": presets, "preset": key})
    form = JobForm(request.POST)
    if not form.is_valid():
        return render(request, "dashboard/job_new.html", {"form": form, "presets": presets}, status=400)
    spec: JobSpec = form.spec
    problems = launch_services.preflight(spec=spec)
    if problems:
        for problem in problems:
            key, _, message = problem.partition(": ")  # "max_no_progress_restarts: needs NVRx 0.6.0 ..."
            field = form.field_for(key) if message else None
            form.add_error(field, f"Cannot launch: {message if field else problem}")
        return render(request, "dashboard/job_new.html", {"form": form, "presets": presets}, status=400)
    if not _confirmed(request):
        return _confirm(
            request,
            job=None,
            title=f"Start job “{form.cleaned_data['name']}”?",
            message=f"{spec.world_size} rank(s) on {spec.backend}, preset {spec.preset}, {spec.steps} steps"
            f"{', ' + str(len(spec.drills)) + ' fault drill(s)' if spec.drills else ''}.",
        )
    job = services.create_job(
        name=form.cleaned_data["name"],
        spec=spec,
        created_by=request.user,
        notify_webhook_url=form.cleaned_data["notify_webhook_url"] or "",
        notify_email=form.cleaned_data["notify_email"] or "",
        remote_addr=_remote_addr(request),
    )
    messages.success(request, f"Job #{job.pk} created; the launcher is starting it.")
    return redirect("dashboard:job", job_id=job.pk)
