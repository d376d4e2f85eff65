"""Every operator API input is bounded and answered in JSON (issue 33): nesting, NaN/Infinity, numbers past
their bounds, oversized bodies, entrypoints that do not import in the job's environment; and a schema-driven
fuzzer over the writes finds no 5xx."""

from __future__ import annotations

import base64
import json

import pytest
import schemathesis
from django.contrib.auth.models import User
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings

from controlplane.jobs.models import Job
from tests.controlplane.api.test_operator_openapi import DOC, _connection_kept

pytestmark = pytest.mark.django_db


@pytest.fixture()
def send(client):
    client.force_login(User.objects.create_user("op", password="x", is_superuser=True))

    def send(url, body, **extra):
        data = body if isinstance(body, bytes) else json.dumps(body)
        r = client.post(url, data=data, content_type="application/json", **extra)
        assert r["Content-Type"] == "application/json", (r.status_code, r.content[:200])
        return r.status_code, r.json()

    return send


def test_it_refuses_abusive_job_bodies_with_json_4xx(send):
    deep = b'{"name": "x", "spec": {"env": ' + b'{"a": ' * 5000 + b'1' + b'}' * 5000 + b'}}'
    assert send("/api/v1/jobs", deep)[0] == 400
    status, out = send("/api/v1/jobs", b'{"spec": ' + b'[' * 20 + b']' * 20 + b'}')
    assert status == 400 and "depth limit" in out["error"]
    status, out = send("/api/v1/jobs", b'{"spec": {"heartbeat_interval_s": NaN}}')
    assert status == 400 and "NaN" in out["error"]
    assert send("/api/v1/jobs", b'{"spec": {"step_timeout_s": Infinity}}')[0] == 400
    assert send("/api/v1/jobs", b'{"spec": {"steps": 1e400}}')[0] == 400
    status, out = send("/api/v1/jobs", b'{"spec": {"steps": 1' + b'0' * 400 + b'}}')
    assert status == 400
    status, out = send("/api/v1/jobs", {"spec": {"steps": 10**15}})
    assert status == 422 and "steps" in out["fields"]
    for name, value in (("procs_per_node", 2**31), ("max_job_restarts", 10**9), ("keep_checkpoints", 10**7),
                        ("heartbeat_interval_s", 1e12), ("stall_timeout_s", 1e300)):
        status, out = send("/api/v1/jobs", {"spec": {name: value}})
        assert status == 422 and name in out["fields"], (name, out)
    status, out = send("/api/v1/jobs", {"name": "a\x00b"})
    assert status == 422 and out["field"] == "name"
    assert Job.objects.count() == 0


def test_it_answers_an_oversized_body_413_json_without_reading_it(send):
    status, out = send("/api/v1/jobs", b'{"name": "' + b'x' * (10 * 1024 * 1024) + b'"}')
    assert status == 413 and "larger than" in out["error"]
    job = Job.objects.create(name="j", spec={}, status="running")
    status, out = send(f"/api/v1/jobs/{job.pk}/commands", b" " * (3 * 1024 * 1024))
    assert status == 413


def test_it_refuses_abusive_command_bodies_with_json_4xx(send):
    job = Job.objects.create(name="j", spec={}, status="running")
    cmds = f"/api/v1/jobs/{job.pk}/commands"
    assert send(cmds, b'{"kind": "stop", "x": ' + b'[' * 3000 + b']' * 3000 + b'}')[0] == 400
    assert send(cmds, b'{"kind": "inject_fault", "fault": "exception", "rank": NaN}')[0] == 400
    status, out = send(cmds, {"kind": "inject_fault", "fault": "exception", "rank": 10**30})
    assert status in (409, 422), out


def test_it_checks_a_module_or_function_entrypoint_imports_at_preflight(send, tmp_path):
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "train.py").write_text("def main():\n    pass\n\nnot_a_function = 3\n")
    (tmp_path / "broken.py").write_text("import no_such_module_anywhere\ndef main():\n    pass\n")

    def create(entrypoint, working_dir):
        spec = {"entrypoint": entrypoint, "working_dir": working_dir, "procs_per_node": 1}
        return send("/api/v1/jobs", {"name": "mine", "spec": spec})

    for entrypoint, working_dir, words in (
            ("passwd", "/etc", "no module passwd"),
            ("os:system", str(tmp_path), "not your training code"),
            ("json", str(tmp_path), "not your training code"),
            ("mypkg.nothere", str(tmp_path), "no module mypkg.nothere"),
            ("mypkg.train:nothere", str(tmp_path), "no Python function nothere"),
            ("mypkg.train:not_a_function", str(tmp_path), "no Python function"),
            ("broken:main", str(tmp_path), "ModuleNotFoundError")):
        status, out = create(entrypoint, working_dir)
        assert status == 422 and out["field"] == "entrypoint", (entrypoint, out)
        assert words in out["fields"]["entrypoint"], (entrypoint, out)
    assert create("mypkg.train:main", str(tmp_path))[0] == 201
    assert create("mypkg.train", str(tmp_path))[0] == 201


def test_it_answers_a_schema_driven_fuzzer_over_the_writes_without_a_5xx(client, settings):
    """Negative and positive cases over every POST (jobs, commands, resilience checks): every answer is JSON
    and below 500."""
    from controlplane.wsgi import application

    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # Basic hashes per request
    User.objects.create_user("op", password="x", is_superuser=True)
    job = Job.objects.create(name="j", spec={}, status="running")
    basic = "Basic " + base64.b64encode(b"op:x").decode()
    with _connection_kept():
        api = schemathesis.openapi.from_wsgi(DOC, application)
        writes = [op.ok() for op in api.get_all_operations() if op.ok().method.upper() == "POST"]
        assert len(writes) == 3  # jobs, commands, resilience checks
        for op in writes:
            for mode in (schemathesis.GenerationMode.NEGATIVE, schemathesis.GenerationMode.POSITIVE):
                params = {"job_id": job.pk} if "{job_id}" in op.path else {}

                @hsettings(max_examples=30, derandomize=True, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck))
                @given(case=op.as_strategy(mode, path_parameters=params))
                def fuzz(case):
                    if params:  # noqa: B023 - fuzz() runs at once, in this iteration
                        case.path_parameters = params  # noqa: B023
                    case.headers = {**{k: v for k, v in (case.headers or {}).items()
                                        if k.lower() != "authorization"}, "Authorization": basic}
                    r = case.call()
                    assert r.status_code < 500, (case.body, r.status_code, r.text[:300])
                    assert r.headers.get("content-type", [""])[0].startswith("application/json"), (
                        case.body, r.status_code, r.text[:300])

                fuzz()
