"""Raw ASGI fast path for ``POST /api/v1/jobs/<id>/ingest``; everything else goes to Django.

Why: under Django's ASGI handler every request runs its sync view in a fresh thread context, so
persistent database connections are not reused (each request opens a new Postgres connection) and
the middleware stack costs more than the ingest work of a small batch. Here the request is read by
the event loop and handed, whole, to ONE dedicated thread per server process, which keeps its
database connection (``CONN_MAX_AGE``) and calls the same ``views.handle`` as the Django view (same
checks, same answers). Two lanes, each one such thread: batches that carry events (cycle marks,
faults, checkpoints: database writes) and batches of heartbeats alone (the Redis store), so a restart
storm's backlog of event batches never delays another job's heartbeats (``make bench-fleet``: another
job's beats waited p50 0.54 s / p99 1.49 s behind a 600,000-mark storm in one lane). The lane is
chosen from the body's bytes (``"events":[]`` or no ``"events"`` key: heartbeats alone); a batch in
the wrong lane is still handled in full, only its queue differs. Host checking and middleware do not
apply to this machine-facing route; authentication is the job token.

Use: ``application = with_ingest(get_asgi_application())``, as ``controlplane.asgi.application`` does.
"""

from __future__ import annotations

import asyncio
import logging
import re
from concurrent.futures import ThreadPoolExecutor

import orjson
from django.conf import settings

from controlplane.ingest import liveness

log = logging.getLogger(__name__)

SHED_RETRY_AFTER_S = 2

_PATH = re.compile(r"^/api/v1/jobs/(\d{1,18})/ingest$")
_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ingest")
_beats_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ingest-beats")
# Batches this process has taken and not answered yet (read by the event loop only). Past
# ``INGEST_MAX_PENDING`` a new batch is shed: 429 with Retry-After, before its body is read. The trainers'
# reporters spool it and retry after that long; the time counts as outage grace (``liveness``).
_pending = 0


def _run(job_id: int, authorization: str, content_length: str | None, body: bytes) -> tuple[int, dict, dict]:
    from django.db import connection

    from controlplane.ingest import views

    # This one thread keeps its database connection for good (whatever CONN_MAX_AGE says: the web
    # process runs with 0, since Django's ASGI handler gives each request its own thread); a
    # failure closes it and the next batch reconnects.
    try:
        return views.handle(job_id, authorization, content_length, body)
    except Exception:
        log.exception("ingest for job %s failed", job_id)
        connection.close()
        return 500, views.INTERNAL_ERROR, {}


async def _respond(send, status: int, payload: dict, headers: dict[str, str]) -> None:
    body = orjson.dumps(payload)
    hs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    hs += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": hs})
    await send({"type": "http.response.body", "body": body})


async def _ingest(scope, receive, send, job_id: int) -> None:
    if scope["method"] != "POST":
        await _respond(send, 405, {"error": "use POST with a JSON batch (see /api/v1/openapi.json)",
                                   "field": None}, {"Allow": "POST"})
        return
    global _pending
    limit = settings.INGEST_MAX_PENDING
    if limit and _pending >= limit:
        liveness.shed()
        await _respond(send, 429, {
            "error": f"the control plane is shedding load ({_pending} batches queued in this process); "
                     f"retry after {SHED_RETRY_AFTER_S} s (the trainers' reporters spool and retry)",
            "field": None}, {"Retry-After": str(SHED_RETRY_AFTER_S)})
        return
    _pending += 1
    try:
        await _take(scope, receive, send, job_id)
    finally:
        _pending -= 1


async def _take(scope, receive, send, job_id: int) -> None:
    headers = dict(scope["headers"])
    auth = headers.get(b"authorization", b"").decode("latin-1")
    clen = headers.get(b"content-length")
    limit = settings.INGEST_MAX_BODY_BYTES
    chunks: list[bytes] = []
    size = 0
    more = True
    while more:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return
        chunk = msg.get("body", b"")
        more = msg.get("more_body", False)
        if size <= limit:  # keep at most limit+1 bytes; drain the rest
            chunks.append(chunk[: limit + 1 - size])
        size += len(chunk)
    body = b"".join(chunks)
    loop = asyncio.get_running_loop()
    lane = _beats_executor if beats_only(body) else _executor
    status, payload, extra = await loop.run_in_executor(
        lane, _run, job_id, auth, clen.decode("latin-1") if clen else None, body)
    await _respond(send, status, payload, extra)


def beats_only(body: bytes) -> bool:
    """Whether a batch's bytes hold no events (the lane only: ``views.handle`` parses it in full)."""
    return b'"events"' not in body or (body.count(b'"events"') == 1 and (
        b'"events":[]' in body or b'"events": []' in body))


def with_ingest(app):
    """Wrap an ASGI app so the ingest route takes the fast path."""
    if getattr(app, "has_ingest_fast_path", False):
        return app

    async def application(scope, receive, send):
        if scope["type"] == "http":
            m = _PATH.match(scope["path"])
            if m is not None:
                return await _ingest(scope, receive, send, int(m[1]))
        return await app(scope, receive, send)

    application.has_ingest_fast_path = True  # type: ignore[attr-defined]
    return application
