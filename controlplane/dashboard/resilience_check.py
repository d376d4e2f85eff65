""""Check resilience": an operator starts a run of a job's own spec with a drill plan
(``jobs.drill_plan``). GET shows the plan form with the default plan and its time budget; POST with
``preview`` recomputes the budget for the chosen plan; POST with ``start`` launches the run (CSRF,
audited by the service) and opens its page."""

from __future__ import annotations

from django.contrib import messages
from django.shortcuts import get_object_or_404, redirect, render

from controlplane.dashboard.actions import operator_required
from controlplane.jobs import drill_plan
from controlplane.jobs.models import Job
from controlplane.jobs.spec import SpecError
from controlplane.launchers import services as launch_services


def _plan_from(data, default: drill_plan.Plan) -> drill_plan.Plan:
    if "faults" not in data and "repeats" not in data:
        return default
    try:
        repeats = int(data.get("repeats") or 1)
    except ValueError:
        raise drill_plan.PlanError({"repeats": "must be a whole number within 1..10"}) from None
    return drill_plan.Plan(faults=tuple(data.getlist("faults")), placements=tuple(data.getlist("placements")),
                           ranks=tuple(data.getlist("ranks")), repeats=repeats)


@operator_required
def job_check(request, job_id: int):
    job = get_object_or_404(Job, pk=job_id)
    try:
        spec = job.job_spec
    except SpecError as e:
        messages.error(request, f"this job's spec no longer validates: {e}")
        return redirect("dashboard:job", job_id=job.pk)
    default = drill_plan.default_plan(spec)
    errors: dict[str, str] = {}
    plan = default
    est = None
    try:
        plan = _plan_from(request.POST if request.method == "POST" else request.GET, default)
        est = drill_plan.budget(job, spec, plan)
        run_spec = drill_plan.plan_spec(spec, plan)
    except drill_plan.PlanError as e:
        errors = e.errors
    if request.method == "POST" and "start" in request.POST and not errors:
        problems = launch_services.preflight(spec=run_spec)
        if problems:
            errors["spec"] = "cannot launch: " + "; ".join(problems)
        else:
            run = drill_plan.start_resilience_check(job=job, plan=plan, requested_by=request.user,
                                                    remote_addr=request.META.get("REMOTE_ADDR") or None)
            messages.success(request, f"Resilience check started as job #{run.pk}; its report fills in as "
                                      "the drills land.")
            return redirect("dashboard:job", job_id=run.pk)
    return render(request, "dashboard/resilience_check.html", {
        "job": job, "plan": plan, "errors": errors, "budget": est,
        "drills": drill_plan.schedule(spec, plan)[0] if not errors else (),
        "faults": drill_plan.supported_faults(spec), "placements": drill_plan.PLACEMENTS,
        "ranks": drill_plan.RANKS, "last_rank": spec.world_size - 1,
        "all_faults": drill_plan.LEVEL2_FAULTS,
    }, status=422 if errors and request.method == "POST" else 200)
