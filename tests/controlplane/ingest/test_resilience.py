"""Nothing is lost when a part dies: a real uvicorn server (the production app) is killed and restarted
under the trainer's real reporter; Redis is unreachable; the watchdog runs late.

The server subprocess must see the test's rows, so these tests need PostgreSQL (a committed,
shared test database); they skip without it.
"""

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from django.db import connection

from controlplane.jobs import heartbeats, supervision
from controlplane.jobs.models import Event, Fault, Rank
from tests.controlplane.conftest import make_job, needs_postgres
from trainer.ports import free_port
from trainer.reporter import HttpReporter
from trainer.wire import EventKind

ROOT = Path(__file__).resolve().parents[3]
pytestmark = [needs_postgres(), pytest.mark.django_db(transaction=True), pytest.mark.postgres]


class Server:
    """``uvicorn controlplane.asgi:application`` on the test database."""

    def __init__(self, port: int, *, redis_url: str = ""):
        s = connection.settings_dict
        db = f"postgres://{s['USER']}@{s['HOST']}:{s['PORT']}/{s['NAME']}"
        self.env = {**os.environ, "DATABASE_URL": db, "REDIS_URL": redis_url, "UNBROKEN_DEBUG": "false",
                    "UNBROKEN_LOG_LEVEL": "WARNING", "PYTHONPATH": str(ROOT)}
        self.port = port
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "controlplane.asgi:application", "--host", "127.0.0.1",
             "--port", str(self.port), "--no-access-log", "--log-level", "warning"], cwd=ROOT, env=self.env)
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api/v1/openapi.json", timeout=1):
                    return
            except OSError:
                time.sleep(0.1)
        raise AssertionError("the server did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def server():
    srv = Server(free_port())
    yield srv
    srv.kill()


def wait_for(pred, timeout_s: float = 20.0) -> bool:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return False


def test_it_loses_nothing_when_the_server_is_killed_and_restarted(server, tmp_path):
    job, token = make_job(spec={"procs_per_node": 2})
    server.start()
    rep = HttpReporter(url=f"http://127.0.0.1:{server.port}", job_id=str(job.pk), token=token, source="rank:1",
                       rank=1, spool_dir=str(tmp_path), interval_s=0.1, timeout_s=2.0)
    try:
        for step in range(1, 6):
            rep.heartbeat(step=step, phase="train")
            rep.event(EventKind.CHECKPOINT, {"step": step, "mode": "sync", "state": "durable"})
        assert wait_for(lambda: Event.objects.filter(job=job).count() == 5)
        server.kill()
        for step in range(6, 11):  # the server is down: the reporter spools
            rep.heartbeat(step=step, phase="train")
            rep.event(EventKind.CHECKPOINT, {"step": step, "mode": "sync", "state": "durable"})
        time.sleep(1.0)
        assert Event.objects.filter(job=job).count() == 5
        server.start()
        assert wait_for(lambda: Event.objects.filter(job=job).count() == 10), "spooled batches not replayed"
        assert wait_for(lambda: Rank.objects.filter(job=job, rank=1, last_step=10).exists())
    finally:
        rep.close()
    assert sorted(job.checkpoints.values_list("step", flat=True)) == list(range(1, 11))  # each once


def test_it_keeps_heartbeats_in_the_database_while_redis_is_unreachable(tmp_path):
    srv = Server(free_port(), redis_url="redis://127.0.0.1:1/0")  # nothing listens there
    job, token = make_job(spec={"procs_per_node": 2})
    srv.start()
    try:
        body = (f'{{"v":1,"sent_at":{time.time()},"heartbeats":[{{"rank":0,"step":3,"phase":"train",'
                f'"at":{time.time()}}}]}}').encode()
        req = urllib.request.Request(f"http://127.0.0.1:{srv.port}/api/v1/jobs/{job.pk}/ingest", data=body,
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200
        assert Rank.objects.get(job=job, rank=0).last_step == 3
    finally:
        srv.kill()


def test_it_records_the_loss_once_when_the_watchdog_runs_after_a_restart(server, tmp_path):
    job, token = make_job(spec={"procs_per_node": 2, "step_timeout_s": 2.0, "heartbeat_interval_s": 0.5})
    server.start()
    rep = HttpReporter(url=f"http://127.0.0.1:{server.port}", job_id=str(job.pk), token=token, source="rank:0",
                       rank=0, spool_dir=str(tmp_path), interval_s=0.1)
    rep.heartbeat(step=1, phase="train")
    rep.close()
    assert wait_for(lambda: Rank.objects.filter(job=job, rank=0).exists())
    # The deadline passes while no watchdog runs, and the server's ingest beacon ticks after it (a rank is
    # lost only once ingest has shown life after its deadline: controlplane/jobs/outages.py).
    time.sleep(3.5)
    store = heartbeats.DbHeartbeatStore()  # the server above runs without Redis; so does this watchdog
    assert supervision.mark_overdue(store=store) == 1
    assert supervision.mark_overdue(store=store) == 0
    assert Fault.objects.filter(job=job, fault_class="heartbeat_lost").count() == 1
