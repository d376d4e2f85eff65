"""The operator API's OpenAPI document: generated from the types the views use, served beside the ingest
one, and held to by the server under a schema-driven fuzzer (schemathesis) over every read."""

from __future__ import annotations

import json
from contextlib import contextmanager

import pytest
import schemathesis
from django.contrib.auth.models import User
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from controlplane.api import openapi, schema
from tests.controlplane.api import drill
from tests.controlplane.api.conformance import conforms
from trainer.wire import FaultClass

pytestmark = pytest.mark.django_db
DOC = "/api/v1/operator/openapi.json"
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def test_it_serves_the_document_beside_the_ingest_one(client):
    r = client.get(DOC)
    assert r.status_code == 200 and r["Content-Type"] == "application/json"
    doc = r.json()
    assert doc["openapi"].startswith("3.1") and "/api/v1/openapi.json" in doc["info"]["description"]
    assert client.get("/api/v1/openapi.json").json()["info"]["title"] == "Unbroken ingest API"
    ops = {(p, m) for p, methods in doc["paths"].items() for m in methods}
    assert {(r.path, r.method) for r in openapi.ROUTES} == ops


def test_it_generates_the_schemas_from_the_view_types():
    doc = openapi.document()
    fault = doc["components"]["schemas"]["Fault"]
    assert set(fault["properties"]) == set(schema.Fault.__struct_fields__)
    assert set(fault["required"]) == set(schema.Fault.__struct_fields__)
    params = {p["name"]: p for p in doc["paths"]["/api/v1/jobs/{job_id}/faults"]["get"]["parameters"]}
    assert set(params) == {"job_id", *schema.FaultsQuery.__struct_fields__}
    assert params["limit"]["schema"]["maximum"] == 500
    assert set(doc["components"]["schemas"]["FaultClass"]["enum"]) == {c.value for c in FaultClass}
    post = doc["paths"]["/api/v1/jobs/{job_id}/commands"]["post"]
    body = post["requestBody"]["content"]["application/json"]
    assert body["schema"] == {"$ref": "#/components/schemas/CommandCreate"}
    assert doc["components"]["schemas"]["CommandCreate"]["additionalProperties"] is False


def test_it_declares_json_errors_for_every_operation():
    for path, methods in openapi.document()["paths"].items():
        for method, op in methods.items():
            errors = {k: v for k, v in op["responses"].items() if k.startswith(("4", "5"))}
            assert {"401", "405", "422"} <= set(errors), (method, path)
            assert all(v["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}
                       for v in errors.values())


def test_it_answers_a_schema_driven_fuzzer_over_every_read(client, post, settle):
    from controlplane.wsgi import application

    operator = User.objects.create_user("op", password="x", is_superuser=True)
    job = drill.build(post, settle, user=operator, finish=False)
    client.force_login(operator)
    cookie = {"sessionid": client.cookies["sessionid"].value}
    with _connection_kept():
        api = schemathesis.openapi.from_wsgi(DOC, application)
        reads = [op.ok() for op in api.get_all_operations() if op.ok().method.upper() == "GET"]
        assert len(reads) == sum(r.method == "get" for r in openapi.ROUTES) == 14
        for op in reads:
            _fuzz(op, job, cookie)


def _fuzz(op, job, cookie):
    params = {"job_id": job.pk} if "{job_id}" in op.path else {}
    if "{fault_id}" in op.path:
        params["fault_id"] = job.faults.order_by("id").values_list("id", flat=True).first()

    @settings(max_examples=25, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(schemathesis.GenerationMode.POSITIVE, path_parameters=params))
    def fuzz(case):
        if params:
            case.path_parameters = params
        # The session signs in; generated credentials would only be refused (401).
        case.headers = {k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"}
        case.cookies = dict(cookie)
        r = case.call_and_validate(checks=CHECKS)
        assert r.status_code == 200, (case.path, case.query, r.text)

    fuzz()


@contextmanager
def _connection_kept():
    """Called as a WSGI app, Django closes the database connection after each request (the test's
    transaction with it); the test client keeps it the same way, by not listening for those signals."""
    from django.core.signals import request_finished, request_started
    from django.db import close_old_connections

    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        yield
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


def test_it_answers_writes_as_documented(client):
    operator = User.objects.create_user("op", password="x", is_superuser=True)
    client.force_login(operator)
    doc = client.get(DOC).json()

    def send(url, body, want):
        data = body if isinstance(body, bytes) else json.dumps(body)
        r = client.post(url, data=data, content_type="application/json")
        assert r.status_code == want, r.content
        conforms(doc, "post", url, r)
        return r.json()

    job = send("/api/v1/jobs", {"name": "demo", "spec": {"steps": 50, "procs_per_node": 2}}, 201)
    assert job["links"]["self"] == f"/api/v1/jobs/{job['id']}" and job["status"] in ("pending", "launching")
    assert send("/api/v1/jobs", {"name": "x", "spec": {"steps": "many"}}, 422)["fields"]["steps"]
    assert send("/api/v1/jobs", {"name": ""}, 422)["field"] == "name"
    assert send("/api/v1/jobs", {"nme": "x"}, 422)["fields"] == {"nme": "unknown field"}
    assert "malformed JSON" in send("/api/v1/jobs", b"{nope", 400)["error"]
    assert send("/api/v1/jobs", b"[]", 400)["error"]
    assert send("/api/v1/jobs", {"name": "x" * 70000}, 413)["error"]
    cmds = f"/api/v1/jobs/{job['id']}/commands"
    cmd = send(cmds, {"kind": "restart", "level": "in_process"}, 202)
    assert (cmd["kind"], cmd["level"], cmd["status"], cmd["issued_by"]) == (
        "restart", "in_process", "pending", "op")
    assert send(cmds, {"kind": "restart"}, 422)["field"] == "level"
    assert send(cmds, {"kind": "restart", "level": "galaxy"}, 422)["field"] == "level"
    assert send(cmds, {"kind": "inject_fault", "fault": "exception"}, 422)["field"] == "rank"
    assert send(cmds, {"kind": "explode"}, 422)["field"] == "kind"
    assert "rank 7" in send(cmds, {"kind": "inject_fault", "fault": "exception", "rank": 7}, 409)["error"]
    assert send("/api/v1/jobs/999999/commands", {"kind": "stop"}, 404) == {"error": "no job 999999"}
