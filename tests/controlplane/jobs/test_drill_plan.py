"""A resilience check's drill plan (``jobs/drill_plan.py``), and starting one from the API and the job page:
operators only, CSRF on the page, audited, an ordinary job tagged with its plan."""

from __future__ import annotations

import base64

import pytest
from django.test import Client

from controlplane.jobs import drill_plan
from controlplane.jobs.models import AuditEntry, Job
from controlplane.jobs.spec import DEMO_SPEC, JobSpec
from tests.controlplane.dashboard.factories import PASSWORD, make_job, make_user

pytestmark = pytest.mark.django_db
PLAIN = JobSpec.from_dict({"entrypoint": "plain_fsdp.py", "args": ["--steps", "400"], "env": {"MY_FLAG": "1"},
                           "procs_per_node": 2, "steps": 400, "working_dir": "/tmp"})


def test_it_covers_every_class_the_level_supports_twice():
    drills, steps = drill_plan.schedule(DEMO_SPEC, drill_plan.default_plan(DEMO_SPEC))
    per_fault: dict[str, list[int]] = {}
    for d in drills:
        per_fault.setdefault(d.fault, []).append(d.rank)
    # killed_during_save is a sigkill while a save is in flight: sigkill four times in all.
    assert {f: sorted(r) for f, r in per_fault.items()} == {
        "exception": [0, 1], "hang": [0, 1], "sigkill": [0, 0, 1, 1], "nan_loss": [0, 1],
        "hang_collective": [0, 1]}
    interval = DEMO_SPEC.checkpoint_interval
    gaps = [b.step - a.step for a, b in zip(drills, drills[1:], strict=False)]
    assert min(gaps) >= interval  # each recovery is over before the next drill
    assert sum(1 for d in drills if d.fault == "sigkill" and d.step % interval == 1) == 2  # a save in flight
    assert steps == drills[-1].step + 2 * interval
    spec = drill_plan.plan_spec(DEMO_SPEC, drill_plan.default_plan(DEMO_SPEC))
    assert spec.drills == drills and spec.steps == steps  # and it validates as a spec


def test_it_keeps_an_own_script_to_what_level_0_can_drill():
    assert drill_plan.supported_faults(PLAIN) == ("exception", "hang", "sigkill")
    spec = drill_plan.plan_spec(PLAIN, drill_plan.default_plan(PLAIN))
    same = ("entrypoint", "args", "env", "in_process", "working_dir")
    assert [getattr(spec, k) for k in same] == [getattr(PLAIN, k) for k in same]
    assert len(spec.drills) == 6
    with pytest.raises(drill_plan.PlanError, match="nan_loss: not at this job's integration level"):
        drill_plan.schedule(PLAIN, drill_plan.Plan(faults=("nan_loss",)))


def test_it_lays_out_placements_ranks_and_repeats():
    plan = drill_plan.Plan(faults=("exception",), placements=("after_save", "before_save"), ranks=("last",),
                           repeats=3)
    drills, _ = drill_plan.schedule(DEMO_SPEC, plan)
    assert len(drills) == 6 and {d.rank for d in drills} == {1}
    assert sorted({d.step % 20 for d in drills}) == [4, 19]
    for bad, field in ((dict(placements=("whenever",)), "placements"), (dict(ranks=()), "ranks"),
                       (dict(repeats=11), "repeats"), (dict(faults=()), "faults")):
        with pytest.raises(drill_plan.PlanError) as e:
            drill_plan.check(DEMO_SPEC, drill_plan.Plan(**{"faults": ("exception",), **bad}))
        assert field in e.value.errors


def test_it_budgets_about_ten_minutes_for_the_demo():
    job = make_job(spec=DEMO_SPEC.to_dict())
    est = drill_plan.budget(job, DEMO_SPEC, drill_plan.default_plan(DEMO_SPEC))
    assert not est.measured and 5 * 60 <= est.total_s <= 15 * 60


def _basic(name):
    return {"HTTP_AUTHORIZATION": "Basic " + base64.b64encode(f"{name}:{PASSWORD}".encode()).decode()}


def test_it_starts_a_tagged_run_from_the_api(django_capture_on_commit_callbacks):
    make_user("op", operator=True)
    make_user("viewer")
    job = make_job(spec=DEMO_SPEC.to_dict())
    c = Client()
    url = f"/api/v1/jobs/{job.pk}/resilience-checks"
    assert c.post(url, {}, content_type="application/json", **_basic("viewer")).status_code == 403
    dry = c.post(url, {"dry_run": True}, content_type="application/json", **_basic("op"))
    assert dry.status_code == 200 and dry.json()["run"] is None and len(dry.json()["drills"]) == 12
    assert Job.objects.count() == 1
    bad = c.post(url, {"faults": ["meteor"]}, content_type="application/json", **_basic("op"))
    assert bad.status_code == 422 and "faults" in bad.json()["fields"]
    with django_capture_on_commit_callbacks(execute=False):
        resp = c.post(url, {"faults": ["exception", "sigkill"], "repeats": 2},
                      content_type="application/json", **_basic("op"))
    assert resp.status_code == 201, resp.content
    run = Job.objects.get(pk=resp.json()["run"])
    assert run.spec["preset"] == DEMO_SPEC.preset and len(run.spec["drills"]) == 8
    plan = drill_plan.plan_of(run)
    assert plan["plan"]["faults"] == ["exception", "sigkill"] and plan["source_job"] == job.pk
    assert AuditEntry.objects.filter(job=job, action="job.resilience_check", detail__run=run.pk).exists()


def test_it_starts_one_from_the_job_page_with_csrf(django_capture_on_commit_callbacks):
    make_user("op", operator=True)
    job = make_job(spec=DEMO_SPEC.to_dict())
    c = Client(enforce_csrf_checks=True)
    assert c.login(username="op", password=PASSWORD)
    assert "Check resilience" in c.get(f"/jobs/{job.pk}/").content.decode()
    form = c.get(f"/jobs/{job.pk}/check/")
    assert form.status_code == 200 and b"Time budget" in form.content
    assert c.post(f"/jobs/{job.pk}/check/", {"start": "1"}).status_code == 403  # no CSRF token
    token = form.cookies["csrftoken"].value if "csrftoken" in form.cookies else c.cookies["csrftoken"].value
    with django_capture_on_commit_callbacks(execute=False):
        resp = c.post(f"/jobs/{job.pk}/check/", {
            "start": "1", "csrfmiddlewaretoken": token, "faults": ["hang"], "placements": ["mid_interval"],
            "ranks": ["first"], "repeats": "1"})
    assert resp.status_code == 302
    run = Job.objects.exclude(pk=job.pk).get()
    assert resp["Location"] == f"/jobs/{run.pk}/"
    assert [d["fault"] for d in run.spec["drills"]] == ["hang"]
    assert drill_plan.plan_of(run)["plan"]["ranks"] == ["first"]


def test_it_keeps_viewers_out_of_the_check_form(client):
    viewer = make_user("viewer")
    client.force_login(viewer)
    job = make_job(spec=DEMO_SPEC.to_dict())
    assert client.get(f"/jobs/{job.pk}/check/").status_code == 403
