import json

import pytest

from controlplane.jobs.models import AuditEntry, Command, Job
from tests.controlplane.api.logins import basic

pytestmark = pytest.mark.django_db


def _post(client, url, body, **headers):
    return client.post(url, data=json.dumps(body) if not isinstance(body, bytes) else body,
                       content_type="application/json", **headers)


def test_it_requires_credentials(client):
    r = client.get("/api/v1/jobs")
    assert r.status_code == 401
    assert r["WWW-Authenticate"].startswith("Basic")


def test_it_refuses_a_wrong_password(client, operator):
    r = client.get("/api/v1/jobs", **basic("op", "wrong"))
    assert r.status_code == 401


def test_it_lets_an_operator_create_a_job(client, operator):
    r = _post(client, "/api/v1/jobs", {"name": "demo", "spec": {"steps": 50, "procs_per_node": 2}}, **basic("op"))
    assert r.status_code == 201, r.content
    job = Job.objects.get(pk=r.json()["id"])
    assert job.spec["steps"] == 50 and job.created_by == operator
    assert AuditEntry.objects.filter(job=job, action="job.create", actor=operator).exists()


def test_it_forbids_a_viewer_to_create_a_job(client, viewer):
    r = _post(client, "/api/v1/jobs", {"name": "demo"}, **basic("viewer"))
    assert r.status_code == 403
    assert Job.objects.count() == 0


def test_it_lets_a_viewer_read(client, viewer):
    assert client.get("/api/v1/jobs", **basic("viewer")).status_code == 200


def test_it_names_the_bad_spec_field(client, operator):
    r = _post(client, "/api/v1/jobs", {"name": "x", "spec": {"steps": "many", "procs_per_node": 0}}, **basic("op"))
    assert r.status_code == 422
    assert "steps" in r.json()["fields"]


def test_it_refuses_unknown_spec_fields(client, operator):
    r = _post(client, "/api/v1/jobs", {"name": "x", "spec": {"stepz": 5}}, **basic("op"))
    assert r.status_code == 422
    assert r.json()["fields"] == {"stepz": "unknown field"}


def test_it_rejects_malformed_json(client, operator):
    r = _post(client, "/api/v1/jobs", b"{not json", **basic("op"))
    assert r.status_code == 400
    assert "malformed JSON" in r.json()["error"]


def test_it_rejects_an_oversized_body(client, operator):
    r = _post(client, "/api/v1/jobs", {"name": "x" * 70000}, **basic("op"))
    assert r.status_code == 413


def test_it_queues_an_audited_restart_command(client, operator):
    job = Job.objects.create(name="j", spec={"procs_per_node": 2}, status="running")
    r = _post(client, f"/api/v1/jobs/{job.pk}/commands", {"kind": "restart", "level": "in_process"}, **basic("op"))
    assert r.status_code == 202, r.content
    cmd = Command.objects.get(pk=r.json()["id"])
    assert (cmd.kind, cmd.level, cmd.status) == ("restart", "in_process", "pending")
    assert AuditEntry.objects.filter(job=job, action="job.restart", actor=operator).exists()


def test_it_refuses_an_injection_into_an_unknown_rank(client, operator):
    job = Job.objects.create(name="j", spec={"procs_per_node": 2}, status="running")
    r = _post(client, f"/api/v1/jobs/{job.pk}/commands", {"kind": "inject_fault", "fault": "exception", "rank": 7},
              **basic("op"))
    assert r.status_code == 409
    assert "rank 7" in r.json()["error"]
    assert not Command.objects.exists()


def test_it_refuses_commands_to_a_finished_job(client, operator):
    job = Job.objects.create(name="j", spec={}, status="succeeded")
    r = _post(client, f"/api/v1/jobs/{job.pk}/commands", {"kind": "stop"}, **basic("op"))
    assert r.status_code == 409


def test_it_enforces_csrf_for_session_writes(operator):
    from django.test import Client

    c = Client(enforce_csrf_checks=True)
    c.force_login(operator)
    r = _post(c, "/api/v1/jobs", {"name": "x"})
    assert r.status_code == 403
    assert "CSRF" in r.json()["error"]


def test_it_refuses_a_job_the_launcher_cannot_start(client, operator):
    r = _post(client, "/api/v1/jobs", {"name": "big", "spec": {"preset": "1b"}}, **basic("op"))
    assert r.status_code == 422
    assert any("needs GPUs" in p for p in r.json()["preflight"])
    assert not Job.objects.exists()
