"""OpenAPI 3.1 description of the operator API, generated from the types its views validate and
serialise with (``controlplane.api.schema``, by ``msgspec.json.schema_components``): request bodies,
query parameters, responses and errors. Only the routes' list below is written here: which path and
method takes which types and answers which statuses.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import msgspec

from controlplane.api import schema as s
from controlplane.api.report_schema import Check, CheckCreate, ReportQuery
from controlplane.jobs.resilience_report import Report
from controlplane.jobs.spec import JobSpec

REF = "#/components/schemas/{name}"
DOC_PATH = "/api/v1/operator/openapi.json"


@dataclass(frozen=True)
class Route:
    path: str
    method: str
    operation: str
    summary: str
    response: type
    status: int = 200
    query: type | None = None
    body: type | None = None
    errors: tuple[int, ...] = ()
    html: bool = False  # also answers text/html (its query's ``format=html``)


READ = (401, 404, 405, 422)
WRITE = (400, 401, 403, 404, 405, 409, 413, 422)
JOB = "/api/v1/jobs/{job_id}"
ROUTES = (
    Route("/api/v1/jobs", "get", "listJobs", "Jobs, newest first", s.JobList, query=s.JobsQuery,
          errors=(401, 405, 422)),
    Route("/api/v1/jobs", "post", "createJob", "Start a job (operators)", s.Job, 201, body=s.JobCreate,
          errors=(400, 401, 403, 405, 413, 422)),
    Route(JOB, "get", "getJob", "The job with a summary of everything its page shows", s.JobDetail,
          query=s.NoQuery, errors=READ),
    Route(JOB + "/goodput", "get", "getGoodput", "Where the job's wall time went", s.Goodput, query=s.NoQuery,
          errors=READ),
    Route(JOB + "/report", "get", "getReport", "The job's resilience report, with goodput projected at scale",
          Report, query=ReportQuery, errors=READ, html=True),
    Route(JOB + "/resilience-checks", "post", "startResilienceCheck",
          "Run the job's spec again with a drill plan (operators; dry_run: the plan and its budget only)",
          Check, 201, body=CheckCreate, errors=WRITE),
    Route(JOB + "/ranks", "get", "listRanks", "Ranks by rank number, with their health now", s.RankList,
          query=s.RanksQuery, errors=READ),
    Route(JOB + "/faults", "get", "listFaults", "Faults with their evidence, in the order recorded",
          s.FaultList,
          query=s.FaultsQuery, errors=READ),
    Route(JOB + "/faults/{fault_id}", "get", "getFault", "One fault: why it happened, in one sentence with its proof",
          s.FaultDetail, query=s.NoQuery, errors=READ),
    Route(JOB + "/cycles", "get", "listCycles", "Restart cycles with their marks and durations", s.CycleList,
          query=s.CyclesQuery, errors=READ),
    Route(JOB + "/checkpoints", "get", "listCheckpoints", "The checkpoint ledger", s.CheckpointList,
          query=s.CheckpointsQuery, errors=READ),
    Route(JOB + "/commands", "get", "listCommands", "Commands in the order issued", s.CommandList,
          query=s.CommandsQuery, errors=READ),
    Route(JOB + "/samples", "get", "listSamples", "The loss and throughput history", s.SampleList,
          query=s.SamplesQuery, errors=READ),
    Route(JOB + "/audit", "get", "listAudit", "Who did what to the job, newest first", s.AuditList,
          query=s.Page, errors=READ),
    Route(JOB + "/quarantined", "get", "listQuarantined", "Heartbeat state that could not be stored",
          s.QuarantinedList, query=s.Page, errors=READ),
    Route(JOB + "/log", "get", "getLog", "The end of the job's log", s.Log, query=s.NoQuery, errors=READ),
    Route(JOB + "/commands", "post", "issueCommand", "Stop, restart or inject a fault (operators)", s.Command,
          202, body=s.CommandCreate, errors=WRITE),
)

ERRORS = {
    400: "The body is not a JSON object (malformed, NaN or Infinity, nested deeper than 16 levels).",
    401: "No valid credentials: send an API token (Authorization: Bearer), HTTP Basic credentials of an "
         "Unbroken account, or a session cookie.",
    403: "Not an operator, or a session write without its CSRF token.",
    404: "No such job (or no such fault of it).",
    405: "Another method: the Allow header lists the ones this path takes.",
    409: "The action cannot be carried out now (the job is over, the rank does not exist, ...).",
    413: "The body is larger than 64 KiB.",
    422: "A field or query parameter is invalid: `field` (and `fields`) name it.",
}


def _json(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


def _parameter_schema(prop: dict) -> dict:
    """A query parameter's schema: the property's, without the null a missing parameter stands for."""
    prop = dict(prop)
    branches = prop.pop("anyOf", None)
    if branches:
        rest = [b for b in branches if b != {"type": "null"}]
        prop = {**(rest[0] if len(rest) == 1 else {"anyOf": rest}), **prop}
    if prop.get("default", 0) is None:
        del prop["default"]
    return prop


def _type_the_spec(components: dict, spec_ref: dict) -> None:
    """The views take and show a job's spec as JSON and check it with ``JobSpec.from_dict`` (errors keyed by
    field); the document types it field by field from the same type (bounds, enums, defaults,
    descriptions)."""
    for struct in components.values():
        props = struct.get("properties", {})
        if props.get("spec", {}).get("type") == "object":
            props["spec"] = {**spec_ref, "description": JobSpec.__doc__.strip()}


@cache
def document() -> dict:
    types = sorted({t for r in ROUTES for t in (r.response, r.query, r.body) if t is not None} | {s.Error},
                   key=lambda t: t.__name__)
    refs, components = msgspec.json.schema_components([*types, JobSpec], ref_template=REF)
    ref = dict(zip([*types, JobSpec], refs, strict=True))
    _type_the_spec(components, ref[JobSpec])
    queries = {r.query for r in ROUTES if r.query is not None}
    paths: dict[str, dict] = {}
    for r in ROUTES:
        op: dict = {"operationId": r.operation, "summary": r.summary, "tags": ["operator"]}
        params = []
        if "{job_id}" in r.path:
            params.append({"name": "job_id", "in": "path", "required": True,
                           "schema": {"type": "integer", "minimum": 1}})
        if "{fault_id}" in r.path:
            params.append({"name": "fault_id", "in": "path", "required": True,
                           "schema": {"type": "integer", "minimum": 1}})
        if r.query is not None:
            q = components[r.query.__name__]
            params += [{"name": name, "in": "query", "required": False, "schema": _parameter_schema(prop)}
                       for name, prop in q.get("properties", {}).items()]
        if params:
            op["parameters"] = params
        if r.body is not None:
            op["requestBody"] = {"required": True, "content": _json(ref[r.body])}
        op["responses"] = {str(r.status): {"description": (r.response.__doc__ or r.response.__name__).strip(),
                                           "content": _json(ref[r.response])}}
        if r.html:
            op["responses"][str(r.status)]["content"]["text/html"] = {"schema": {"type": "string"}}
        for code in r.errors:
            op["responses"][str(code)] = {"description": ERRORS[code], "content": _json(ref[s.Error])}
        paths.setdefault(r.path, {})[r.method] = op
    for q in queries:
        components.pop(q.__name__, None)  # inlined as parameters
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Unbroken operator API",
            "version": "1",
            "description": (
                "Start, inspect, restart and stop jobs from scripts and CI. Reading needs any account; "
                "acting needs an operator, and every action is audited. Lists come a page at a time in a "
                "stable order (`limit`, and the cursor `after` that each page's `next` link carries; "
                "`next` is null on the last page). Times are UTC (RFC 3339), durations seconds. The "
                "trainer-facing ingest API is described at /api/v1/openapi.json."
            ),
        },
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {
                "token": {"type": "http", "scheme": "bearer",
                          "description": "a per-user API token (the user menu's API tokens page, or "
                                         "manage.py create_api_token USERNAME); it acts with its user's "
                                         "role"},
                "basic": {"type": "http", "scheme": "basic", "description": "an Unbroken account (use TLS)"},
                "session": {"type": "apiKey", "in": "cookie", "name": "sessionid",
                            "description": "the browser session; writes also need X-CSRFToken"},
            },
        },
        "security": [{"token": []}, {"basic": []}, {"session": []}],
    }


@cache
def document_bytes() -> bytes:
    return msgspec.json.encode(document())
