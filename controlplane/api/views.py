"""The operator API: start, inspect, restart, stop jobs from scripts and CI.

Authentication is HTTP Basic against the user database (use TLS), or the browser session (then
CSRF applies as for any form). Reading needs any account; acting needs an operator. Every action
is audited by the service it calls.
"""

from __future__ import annotations

import base64
import json

from django.contrib.auth import authenticate
from django.http import HttpRequest, JsonResponse
from django.shortcuts import get_object_or_404
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_http_methods

from controlplane.jobs import services
from controlplane.jobs.models import Job
from controlplane.jobs.roles import is_operator
from controlplane.jobs.spec import JobSpec, SpecError
from controlplane.launchers import services as launch_services
from trainer.wire import CommandKind

MAX_BODY = 64 * 1024


def _error(status: int, message: str, **extra) -> JsonResponse:
    return JsonResponse({"error": message, **extra}, status=status)


def _user(request: HttpRequest):
    auth = request.headers.get("Authorization", "")
    if auth.startswith("Basic "):
        try:
            username, _, password = base64.b64decode(auth[6:]).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return None
        return authenticate(request, username=username, password=password)
    if request.user.is_authenticated:
        return request.user
    return None


def _authorise(request: HttpRequest, *, act: bool):
    """Returns (user, None) or (None, error response)."""
    via_basic = request.headers.get("Authorization", "").startswith("Basic ")
    user = _user(request)
    if user is None:
        resp = _error(401, "log in: send HTTP Basic credentials of an Unbroken account")
        resp["WWW-Authenticate"] = 'Basic realm="unbroken"'
        return None, resp
    if act and not via_basic:
        # Session-authenticated writes need the CSRF token like any form post.
        from django.middleware.csrf import CsrfViewMiddleware

        reason = CsrfViewMiddleware(lambda r: None).process_view(request, None, (), {})
        if reason is not None:
            return None, _error(403, "CSRF check failed: send the csrftoken cookie's value in X-CSRFToken")
    if act and not is_operator(user):
        return None, _error(403, "only operators may start, stop, restart or inject faults")
    return user, None


def _body(request: HttpRequest):
    if len(request.body) > MAX_BODY:
        return None, _error(413, f"the body is larger than {MAX_BODY} bytes")
    try:
        data = json.loads(request.body or b"{}")
    except (ValueError, UnicodeDecodeError) as e:
        return None, _error(400, f"malformed JSON: {e}")
    if not isinstance(data, dict):
        return None, _error(400, "the body must be a JSON object")
    return data, None


def job_json(job: Job) -> dict:
    return {
        "id": job.pk, "name": job.name, "status": job.status, "status_reason": job.status_reason,
        "backend": job.backend, "attempt": job.attempt, "last_step": job.last_step,
        "created_at": job.created_at.isoformat(), "spec": job.spec,
    }


@csrf_exempt
@require_http_methods(["GET", "POST"])
def jobs(request: HttpRequest) -> JsonResponse:
    user, err = _authorise(request, act=request.method == "POST")
    if err:
        return err
    if request.method == "GET":
        return JsonResponse({"jobs": [job_json(j) for j in Job.objects.all()[:100]]})
    data, err = _body(request)
    if err:
        return err
    name = data.pop("name", "job")
    if not isinstance(name, str) or not 0 < len(name) <= 100:
        return _error(422, "must be a string of 1 to 100 characters", field="name")
    notify = {k: data.pop(k, "") for k in ("notify_webhook_url", "notify_email")}
    try:
        spec = JobSpec.from_dict(data.pop("spec", {}))
    except SpecError as e:
        return _error(422, str(e), fields=e.errors)
    if data:
        return _error(422, f"unknown fields: {', '.join(sorted(data))}", fields={k: "unknown field" for k in data})
    problems = launch_services.preflight(spec=spec)
    if problems:
        return _error(422, "cannot launch: " + "; ".join(problems), preflight=problems)
    job = services.create_job(name=name, spec=spec, created_by=user, remote_addr=request.META.get("REMOTE_ADDR"),
                              **notify)
    return JsonResponse(job_json(job), status=201)


@csrf_exempt
@require_http_methods(["GET"])
def job_detail(request: HttpRequest, job_id: int) -> JsonResponse:
    _, err = _authorise(request, act=False)
    if err:
        return err
    job = get_object_or_404(Job, pk=job_id)
    nodes = job.rank_nodes()
    faults = job.faults.select_related("cycle").order_by("-at", "-id")[:API_FAULTS]
    return JsonResponse({**job_json(job), "faults": [fault_json(f, nodes) for f in faults]})


API_FAULTS = 100  # the newest faults; the job page pages through all of them


def fault_json(f, nodes: dict[int, str]) -> dict:
    """A fault with its outcome (detection, recovery, steps lost) as the job page shows it."""
    return {"at": f.at.isoformat(), "detected_at": f.detected_at.isoformat(), "rank": f.rank,
            "fault_class": f.fault_class, "detected_by": f.detected_by, "message": f.message,
            **f.outcome(rank_nodes=nodes).as_dict()}


@csrf_exempt
@require_http_methods(["POST"])
def job_commands(request: HttpRequest, job_id: int) -> JsonResponse:
    """{"kind": "stop"} | {"kind": "restart", "level": "in_process|in_job|job", "rank": null}
    | {"kind": "inject_fault", "fault": "exception", "rank": 1}"""
    user, err = _authorise(request, act=True)
    if err:
        return err
    job = get_object_or_404(Job, pk=job_id)
    data, err = _body(request)
    if err:
        return err
    kind = data.get("kind")
    rank = data.get("rank")
    if rank is not None and type(rank) is not int:
        return _error(422, "must be an integer or null", field="rank")
    addr = request.META.get("REMOTE_ADDR")
    try:
        if kind == CommandKind.STOP:
            cmd = services.stop_job(job=job, requested_by=user, remote_addr=addr)
        elif kind == CommandKind.RESTART:
            cmd = services.restart_job(job=job, level=str(data.get("level", "")), rank=rank, requested_by=user,
                                       remote_addr=addr)
        elif kind == CommandKind.INJECT_FAULT:
            if rank is None:
                return _error(422, "inject_fault needs the rank to inject into", field="rank")
            cmd = services.inject_fault(job=job, fault=str(data.get("fault", "")), rank=rank, requested_by=user,
                                        remote_addr=addr)
        else:
            return _error(422, "must be stop, restart or inject_fault", field="kind")
    except services.ActionError as e:
        return _error(409, str(e))
    return JsonResponse({"id": cmd.pk, "kind": cmd.kind, "status": cmd.status}, status=202)
