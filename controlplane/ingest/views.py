"""The machine-facing ingest API (v1): parse, authorise, call ``jobs.ingestion``, answer in JSON.

Hot path, so: no session or ORM work before the token check; the job row (token hash, spec, status)
and the pending-command list are cached per process for a moment (``JOB_CACHE_S``, ``COMMAND_CACHE_S``);
orjson in and out. Errors are ``{"error": "...", "field": "heartbeats[3].rank" | null}``.

Status codes: 401 missing or wrong token, and also an unknown job (a wrong token cannot learn whether a
job exists); 413 body over ``INGEST_MAX_BODY_BYTES``; 400 not JSON; 422 valid JSON that breaks the wire
format (types, unknown ranks, clock skew, event data); 503 the database is unavailable (retry: every
write is idempotent; ``stored`` in the body says what was kept). A finished job still gets 200: its ranks' last events (``rank_finished``, a final
checkpoint) race with the launcher seeing the exit, and facts are never refused for being late; the
response's ``job_status`` tells the trainer, and a finished job gets no commands.
"""

from __future__ import annotations

import logging
import threading
import time

import orjson
from django.conf import settings
from django.db import DatabaseError, OperationalError
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt

from controlplane.ingest.openapi import openapi_schema
from controlplane.jobs import ingestion
from controlplane.jobs.heartbeats import utc
from controlplane.jobs.models import Job, hash_token
from trainer.wire import WireError, parse_batch

log = logging.getLogger(__name__)

JOB_CACHE_S = 2.0
# Commands reach the trainer within one heartbeat interval plus this.
COMMAND_CACHE_S = 0.1
_DB_TRIES = 3

_lock = threading.Lock()
_jobs: dict[int, tuple[float, Job | None]] = {}
_commands: dict[int, tuple[float, list[dict]]] = {}
_NO_HASH = hash_token("")


def _json(obj: object, status: int = 200, headers: dict[str, str] | None = None) -> HttpResponse:
    resp = HttpResponse(orjson.dumps(obj), status=status, content_type="application/json")
    for k, v in (headers or {}).items():
        resp[k] = v
    return resp


def error(status: int, message: str, field: str | None = None, headers: dict[str, str] | None = None) -> HttpResponse:
    return _json({"error": message, "field": field or None}, status, headers)


def _cached_job(job_id: int, *, fresh: bool = False) -> Job | None:
    now = time.monotonic()
    hit = _jobs.get(job_id)
    if hit is not None and hit[0] > now and not fresh:
        return hit[1]
    job = Job.objects.filter(pk=job_id).first()
    with _lock:
        if len(_jobs) > 10000:
            _jobs.clear()
        _jobs[job_id] = (now + JOB_CACHE_S, job)
    return job


def _pending_commands(job: Job) -> list[dict]:
    if not job.is_active:
        return []
    now = time.monotonic()
    hit = _commands.get(job.pk)
    if hit is not None and hit[0] > now:
        return hit[1]
    cmds = ingestion.pending_commands(job.pk, now=utc(time.time()))
    with _lock:
        if len(_commands) > 10000:
            _commands.clear()
        _commands[job.pk] = (now + COMMAND_CACHE_S, cmds)
    return cmds


def clear_caches() -> None:
    with _lock:
        _jobs.clear()
        _commands.clear()


_UNAUTHORIZED = {"WWW-Authenticate": 'Bearer realm="unbroken-ingest"'}


def handle(job_id: int, authorization: str, content_length: str | None, body: bytes) -> tuple[int, dict, dict]:
    """The whole ingest request, transport-free: (status, JSON payload, extra headers).

    Shared by the Django view and the raw ASGI fast path (controlplane/ingest/asgi.py).
    Order: token, size, JSON, wire format, write; every refusal happens before any write.
    """
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return _err(401, "send the job's ingest token as 'Authorization: Bearer <token>'", headers=_UNAUTHORIZED)
    try:
        job = _cached_job(job_id)
    except DatabaseError as e:
        log.error("ingest: cannot load job %s: %s", job_id, e)
        return _err(503, "the database is unavailable; retry later (retries are safe)", headers=_RETRY)
    if job is None or not job.token_hash or not job.token_matches(token):
        # The cached row may predate the token (minted at launch): look again before refusing, since
        # a refused batch is dropped by the reporter.
        try:
            job = _cached_job(job_id, fresh=True)
        except DatabaseError:
            return _err(503, "the database is unavailable; retry later (retries are safe)", headers=_RETRY)
        # Same work whether or not the job exists: a wrong token learns nothing about job ids.
        if not Job(token_hash=job.token_hash if job is not None and job.token_hash else _NO_HASH).token_matches(
                token) or job is None or not job.token_hash:
            return _err(401, "this token is not valid for this job", headers=_UNAUTHORIZED)

    limit = settings.INGEST_MAX_BODY_BYTES
    too_big = f"the body is over {limit} bytes; send smaller batches"
    try:
        declared = int(content_length or 0)
    except ValueError:
        return _err(400, "Content-Length is not a number")
    if declared > limit or len(body) > limit:
        return _err(413, too_big)
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        return _err(400, f"the body is not valid JSON: {e}")

    now_ts = time.time()
    max_age_s = settings.INGEST_MAX_AGE_S
    beats = ingestion.parse_heartbeats_fast(obj, now=now_ts, world_size=job.world_size, max_age_s=max_age_s)
    batch = None
    if beats is None:
        try:
            batch = parse_batch(obj, now=now_ts, world_size=job.world_size, max_age_s=max_age_s)
        except WireError as e:
            return _err(422, e.message, e.field)
        except TypeError:  # an unhashable value where wire.py looks up a vocabulary word (a list as phase)
            return _err(422, "a field that takes a word from the vocabulary holds a list or object; "
                             "see /api/v1/openapi.json")

    now = utc(now_ts)
    for attempt in range(_DB_TRIES):
        try:
            if batch is None:
                result = ingestion.record_heartbeats(job, beats, now=now)
            else:
                result = ingestion.record_batch(job, batch, now=now)
            break
        except ingestion.PartlyStored as e:
            stored = ", ".join(f"{k} {'stored' if v else 'NOT stored'}" for k, v in e.stored.items())
            return _err(503, f"the heartbeat store and the database fallback are unavailable: {stored}; "
                             "retry the whole batch later (retries are safe)", headers=_RETRY, stored=e.stored)
        except OperationalError as e:  # deadlock, serialization failure, lost connection: retry, then 503
            if attempt == _DB_TRIES - 1:
                log.error("ingest for job %s failed: %s", job_id, e)
                return _err(503, "the database is unavailable; nothing was stored; retry later (retries are safe)",
                            headers=_RETRY, stored={"events": False, "heartbeats": False})
    try:
        commands = _pending_commands(job)
    except Exception:  # the batch is stored; commands come with the next one
        log.warning("ingest: could not read job %s's pending commands", job_id, exc_info=True)
        commands = []
    return 200, {"accepted": result.to_wire(), "commands": commands, "server_time": time.time(),
                 "job_status": job.status}, {}


def _err(status: int, message: str, field: str | None = None, headers: dict[str, str] | None = None,
         stored: dict[str, bool] | None = None) -> tuple[int, dict, dict]:
    body: dict = {"error": message, "field": field or None}
    if stored is not None:
        body["stored"] = stored
    return status, body, headers or {}


# True whenever it is sent: anything raised out of ``handle`` was raised before the batch's transaction
# committed (it rolled back), since what fails after the commit is answered by ``handle`` itself (503
# with ``stored``; the training sample never raises).
INTERNAL_ERROR = {"error": "internal error; the batch was not stored, retry later", "field": None,
                  "stored": {"events": False, "heartbeats": False}}


_RETRY = {"Retry-After": "1"}


@csrf_exempt
def ingest(request: HttpRequest, job_id: int) -> HttpResponse:
    if request.method != "POST":
        return error(405, "use POST with a JSON batch (see /api/v1/openapi.json)", headers={"Allow": "POST"})
    limit = settings.INGEST_MAX_BODY_BYTES
    # Read at most one byte over the limit (request.body would apply DATA_UPLOAD_MAX_MEMORY_SIZE instead);
    # a declared length over the limit is refused by ``handle`` without reading.
    try:
        declared = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        declared = 0
    body = b"" if declared > limit else request.read(declared or limit + 1)
    try:
        status, payload, headers = handle(job_id, request.META.get("HTTP_AUTHORIZATION", ""),
                                          request.META.get("CONTENT_LENGTH"), body)
    except Exception:
        log.exception("ingest for job %s failed", job_id)
        return _json(INTERNAL_ERROR, 500)
    return _json(payload, status, headers)


def openapi(request: HttpRequest) -> HttpResponse:
    return _json(openapi_schema(now=time.time()))
