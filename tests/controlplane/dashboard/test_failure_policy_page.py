"""Failure policies on the pages and the API: validation names the field (form and API), the job page says
what the next fault of each class would cause and shows the decisions on the timeline, and a job kept for
debugging offers to release it."""

import base64
import json

import pytest
from django.contrib.auth.models import Group, User
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from controlplane.dashboard.forms import JobForm
from controlplane.dashboard.parts import timeline_part
from controlplane.jobs import policy
from controlplane.jobs.models import Event, Fault
from controlplane.jobs.roles import OPERATORS_GROUP
from controlplane.jobs.spec import DEMO_SPEC, JobSpec

from .factories import PASSWORD, make_job, make_user

pytestmark = pytest.mark.django_db

RULES = [{"match": {"class": "nan_loss"}, "action": "stop", "after": 2}, {"match": {"exit_code": 93}, "action": "stop"}]


def _client(operator=True) -> Client:
    make_user("op", operator=operator)
    c = Client()
    c.login(username="op", password=PASSWORD)
    return c


def _form_data(**extra) -> dict:
    data = {k: v for k, v in JobForm.initial_for(DEMO_SPEC, name="demo").items() if v not in (False, None)}
    return {**data, **extra}


def test_the_form_names_the_rule_and_field_that_is_wrong():
    c = _client()
    bad = json.dumps([{"match": {"class": "nan_loss"}, "action": "stop"}, {"match": {"clas": "hang"}, "action": "x"}])
    resp = c.post(reverse("dashboard:job_new"), _form_data(failure_policy=bad, confirmed="yes"))
    assert resp.status_code == 400
    assert resp.context["form"].errors["failure_policy"] == [
        "failure_policy[1].match.clas: unknown field: match on class, exit_code, signal or reason"]
    resp = c.post(reverse("dashboard:job_new"), _form_data(failure_policy="[{", confirmed="yes"))
    assert resp.context["form"].errors["failure_policy"][0].startswith("not valid JSON")


def test_the_form_stores_the_rules_and_fills_them_in_again():
    c = _client()
    resp = c.post(reverse("dashboard:job_new"), _form_data(failure_policy=json.dumps(RULES), confirmed="yes"))
    assert resp.status_code == 302
    from controlplane.jobs.models import Job

    spec = Job.objects.get().job_spec
    assert [r.action for r in spec.failure_policy] == ["stop", "stop"]
    again = json.loads(JobForm.initial_for(spec, name="x")["failure_policy"])
    assert again[0] == {"match": {"class": "nan_loss"}, "action": "stop", "after": 2, "without_progress": True}


def test_the_api_names_the_bad_rule_field(client):
    user = User.objects.create_user("api-op", password="correct horse battery")
    user.groups.add(Group.objects.get_or_create(name=OPERATORS_GROUP)[0])
    auth = "Basic " + base64.b64encode(b"api-op:correct horse battery").decode()
    body = {"name": "x", "spec": {"failure_policy": [{"match": {"class": "oom"}, "action": "stop"}]}}
    r = client.post("/api/v1/jobs", data=json.dumps(body), content_type="application/json",
                    HTTP_AUTHORIZATION=auth)
    assert r.status_code == 422
    assert r.json()["fields"]["failure_policy[0].match.class"].startswith("must be one of exception, hang")


def test_the_job_page_says_what_the_next_fault_would_cause():
    job = make_job(spec=JobSpec.from_dict({"procs_per_node": 2, "steps": 400, "failure_policy": RULES}).to_dict())
    Fault.objects.create(job=job, fault_class="nan_loss", rank=1, detected_by="trainer", at=timezone.now(),
                         source_key="n1")
    body = _client(operator=False).get(reverse("dashboard:job", args=[job.pk])).content.decode()
    assert 'data-testid="next-fault-table"' in body
    assert "1. nan_loss ×2 without progress → stop the job" in body
    assert '<tr data-class="nan_loss"><td>nan_loss</td><td><strong>stop the job</strong></td>' in body
    assert '<tr data-class="exit code 93"><td>exit code 93</td><td><strong>stop the job</strong></td>' in body
    assert '<tr data-class="exception"><td>exception</td><td>in-process restart</td>' in body


def test_policy_decisions_are_markers_on_the_timeline():
    job = make_job()
    f = Fault.objects.create(job=job, fault_class="exception", rank=0, detected_by="trainer", at=timezone.now(),
                             source_key="e1")
    assert policy.apply_policies() == 0
    fig = timeline_part.timeline_part(job, timezone.now())
    trace = next(t for t in fig["figure"]["data"] if t.get("name") == "policy decision")
    assert trace["customdata"] == ["<b>exception on rank 0: in-process restart</b><br>default: in_process on, 10 left"]
    assert Event.objects.get(job=job, kind=policy.POLICY_EVENT).data["fault_id"] == f.pk


def test_a_job_kept_for_debugging_offers_to_release_it():
    job = make_job(status="failed", launcher_state={"pid": 1, "held": "processes frozen (SIGSTOP), session 1"})
    body = _client().get(reverse("dashboard:job", args=[job.pk])).content.decode()
    assert 'data-testid="held"' in body and "Stop and release" in body
