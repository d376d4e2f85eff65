"""Overload is explicit: past ``UNBROKEN_INGEST_MAX_PENDING`` queued batches a web process sheds new ones
(429 with Retry-After), the trainers' reporters spool and come back later, nothing is lost, and the time
is a ``shedding`` outage (grace for the deadlines; the banner and /metrics say so).

A real uvicorn server (the production app) on the shared PostgreSQL test database; real reporters.
"""

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from controlplane.jobs.models import Event, Outage
from tests.controlplane.conftest import make_job, needs_postgres
from tests.controlplane.ingest.test_resilience import Server, wait_for
from trainer.ports import free_port
from trainer.reporter import HttpReporter
from trainer.wire import EventKind

pytestmark = [needs_postgres(), pytest.mark.django_db(transaction=True), pytest.mark.postgres]
WORLD = 256


@pytest.fixture
def busy_server():
    """A server that sheds whenever a second batch arrives while one is being stored."""
    srv = Server(free_port())
    srv.env["UNBROKEN_INGEST_MAX_PENDING"] = "1"
    srv.start()
    yield srv
    srv.kill()


def _post(port: int, job_id: int, token: str, body: bytes) -> tuple[int, dict, str | None]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/api/v1/jobs/{job_id}/ingest", data=body,
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read()), r.headers.get("Retry-After")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers.get("Retry-After")


def _flood(port: int, job_id: int, token: str, n: int = 24) -> list[tuple[int, dict, str | None]]:
    now = time.time()
    body = json.dumps({"v": 1, "sent_at": now, "heartbeats": [
        {"rank": r, "step": 5, "phase": "train", "at": now, "loss": 1.0, "node": "n"} for r in range(WORLD)]}).encode()
    out: list = []
    barrier = threading.Barrier(n)

    def one() -> None:
        barrier.wait()
        out.append(_post(port, job_id, token, body))

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_it_sheds_past_capacity_with_retry_after_and_says_so(busy_server, client):
    job, token = make_job(spec={"procs_per_node": WORLD})
    answers: list = []
    for _ in range(10):  # rounds of concurrent batches until the queue overflows
        answers += _flood(busy_server.port, job.pk, token)
        if any(a[0] == 429 for a in answers):
            break
    shed = [a for a in answers if a[0] == 429]
    assert shed and all(a[0] in (200, 429) for a in answers), {a[0] for a in answers}
    status, payload, retry_after = shed[0]
    assert retry_after == "2" and payload["field"] is None and "shedding load" in payload["error"]
    assert any(a[0] == 200 for a in answers)  # the queue still drains: what was taken is stored
    # The web's ticker opens the shedding outage (grace for every deadline) and closes it once quiet.
    assert wait_for(lambda: Outage.objects.filter(component="shedding").exists(), 10)
    assert wait_for(lambda: Outage.objects.filter(component="shedding", ended_at__isnull=False).exists(), 15)
    o = Outage.objects.get(component="shedding")
    assert o.started_at <= o.ended_at and "429" in o.detail
    assert "shedding" in Outage.GRACE  # deadlines do not run while beats are shed
    text = client.get("/metrics", REMOTE_ADDR="127.0.0.1").content.decode()
    assert 'unbroken_control_plane_outages_total{component="shedding"} 1.0' in text


def test_reporters_under_overload_lose_nothing_and_store_each_event_once(busy_server, tmp_path):
    job, token = make_job(spec={"nodes": 1, "procs_per_node": 8})
    reps = [HttpReporter(url=f"http://127.0.0.1:{busy_server.port}", job_id=str(job.pk), token=token,
                         source=f"rank:{r}", rank=r, spool_dir=str(tmp_path), interval_s=0.05, timeout_s=10.0)
            for r in range(8)]
    stop = threading.Event()

    def flood() -> None:  # other traffic keeps the one-batch queue full
        while not stop.is_set():
            _flood_small(busy_server.port, job.pk, token)

    flooders = [threading.Thread(target=flood) for _ in range(2)]
    try:
        for t in flooders:
            t.start()
        for step in range(1, 16):
            for r, rep in enumerate(reps):
                rep.heartbeat(step=step, phase="train")
                rep.event(EventKind.CHECKPOINT, {"step": step * 10 + r, "mode": "sync", "state": "durable"})
            time.sleep(0.05)
        stop.set()
        for t in flooders:
            t.join()
        assert wait_for(lambda: Event.objects.filter(job=job).count() == 8 * 15, 60), \
            Event.objects.filter(job=job).count()
    finally:
        stop.set()
        for rep in reps:
            rep.close()
    steps = sorted(job.checkpoints.values_list("step", flat=True))
    assert steps == sorted(s * 10 + r for s in range(1, 16) for r in range(8))  # every save, once
    assert Outage.objects.filter(component="shedding").exists()  # it was really overloaded


def _flood_small(port: int, job_id: int, token: str) -> None:
    now = time.time()
    body = json.dumps({"v": 1, "sent_at": now, "heartbeats": [
        {"rank": r, "step": 1, "phase": "train", "at": now} for r in range(8)]}).encode()
    _post(port, job_id, token, body)
