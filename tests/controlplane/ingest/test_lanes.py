"""The ingest fast path's two lanes (controlplane/ingest/asgi.py): a batch of heartbeats alone is not
queued behind batches that carry events (a restart storm's backlog), and every batch still gets the
whole of ``views.handle``. Driven through the real ASGI app in this process, on PostgreSQL (the lanes'
threads keep their own connections, as in production)."""

import asyncio
import json
import threading
import time

import pytest

from controlplane.ingest import asgi
from controlplane.jobs.models import Event
from tests.controlplane.conftest import make_job, needs_postgres

pytestmark = [needs_postgres(), pytest.mark.django_db(transaction=True), pytest.mark.postgres]


def _body(rank: int, *, events: bool) -> bytes:
    now = time.time()
    batch = {"v": 1, "sent_at": now, "source": f"rank:{rank}",
             "heartbeats": [{"rank": rank, "step": 3, "phase": "train", "at": now}],
             "events": [{"id": f"e-{rank}", "kind": "fault", "at": now, "rank": rank,
                         "data": {"fault": "exception", "message": "boom"}}] if events else []}
    return json.dumps(batch, separators=(",", ":")).encode()


async def _post(job_id: int, token: str, body: bytes) -> int:
    app = asgi.with_ingest(None)  # only the ingest route is asked for
    sent: list[dict] = []
    msgs = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return msgs.pop(0)

    async def send(msg):
        sent.append(msg)

    scope = {"type": "http", "method": "POST", "path": f"/api/v1/jobs/{job_id}/ingest",
             "headers": [(b"authorization", f"Bearer {token}".encode()), (b"content-length", str(len(body)).encode())]}
    await app(scope, receive, send)
    return sent[0]["status"]


def test_heartbeats_are_not_queued_behind_batches_of_events():
    job, token = make_job(spec={"procs_per_node": 2})
    assert asgi.beats_only(_body(0, events=False)) and not asgi.beats_only(_body(0, events=True))
    release = threading.Event()
    asgi._executor.submit(release.wait, 30)  # the events lane is busy (a storm's batch being stored)

    async def both():
        events = asyncio.ensure_future(_post(job.pk, token, _body(1, events=True)))
        beats = await asyncio.wait_for(_post(job.pk, token, _body(0, events=False)), 10)
        queued = not events.done()
        release.set()
        return beats, queued, await asyncio.wait_for(events, 30)

    try:
        beats, events_were_queued, events = asyncio.run(both())
    finally:
        release.set()
    assert beats == 200 and events_were_queued  # answered while the events lane was still busy
    assert events == 200 and Event.objects.filter(job=job, event_id="e-1").exists()  # and that one stored too
