"""Outage grace end to end: a real ``manage.py serve`` (embedded defaults in a fresh data dir) runs a
2-rank job; ingest is stopped (SIGSTOP to the web) for longer than the job's step timeout; no
``heartbeat_lost`` fault follows, and the outage is on record (the timeline draws it:
tests/controlplane/jobs/test_outages.py). Other faults of the job (this machine's load can make the
trainer's own soft timeouts fire) are not this test's subject."""

from __future__ import annotations

import os
import secrets
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "bench"))

from trainer.ports import free_port  # noqa: E402

from bench_chaos import Api, health, wait_for  # noqa: E402

pytestmark = pytest.mark.slow
STEP_TIMEOUT_S = 5.0


def test_it_raises_no_heartbeat_lost_fault_while_ingest_is_stopped_past_the_step_timeout(tmp_path):
    password = secrets.token_urlsafe(12)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "UNBROKEN_SECRET_KEY_FILE")}
    env.update(UNBROKEN_DATA_DIR=str(tmp_path), UNBROKEN_SECRET_KEY=secrets.token_urlsafe(40),
               UNBROKEN_PUBLIC_URL=base, UNBROKEN_OPERATOR_PASSWORD=password,
               PYTHONPATH=f"{ROOT}:{ROOT / 'trainer'}")
    for cmd in (["migrate", "--noinput", "-v", "0"], ["ensure_operator"]):
        subprocess.run([sys.executable, "manage.py", *cmd], cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    out = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - closed at the end
    serve = subprocess.Popen([sys.executable, "manage.py", "serve", "--port", str(port), "--web-workers", "1"],
                             cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    web = job_id = None
    try:
        wait_for(lambda: (h := health(base)) and len(h) == 3, 90, "serve's three children")
        api = Api(base, "operator", password)
        status, body = api.call("POST", "/api/v1/jobs", {"name": "grace", "spec": {
            "preset": "tiny", "steps": 150, "procs_per_node": 2, "checkpoint_interval": 20,
            "step_timeout_s": STEP_TIMEOUT_S, "heartbeat_interval_s": 0.5,
            "in_process": False}})  # a step timeout under the in-process hard timeout needs the layer off
        assert status == 201, body
        job_id = body["id"]

        def job() -> dict:
            return api.call("GET", f"/api/v1/jobs/{job_id}")[1]

        wait_for(lambda: job().get("status") == "running" and job().get("last_step", 0) >= 5, 400, "training")
        web = int(health(base)["web"]["pid"])
        os.killpg(web, signal.SIGSTOP)
        time.sleep(3 * STEP_TIMEOUT_S)
        os.killpg(web, signal.SIGCONT)
        web = None
        # Past the longest deadline the ranks could have had (step timeout after their last beat before
        # the stop), with the watchdog running all along.
        time.sleep(2 * STEP_TIMEOUT_S)
        db = sqlite3.connect(tmp_path / "unbroken.sqlite3")
        lost = db.execute("SELECT rank, message FROM jobs_fault WHERE job_id = ? AND fault_class = 'heartbeat_lost'",
                          [job_id]).fetchall()
        assert lost == []
        spans = db.execute("SELECT julianday(ended_at) - julianday(started_at) FROM jobs_outage "
                           "WHERE component = 'ingest'").fetchall()
        assert len(spans) == 1 and spans[0][0] * 86400 > 2 * STEP_TIMEOUT_S, spans
    finally:
        if web is not None:
            os.killpg(web, signal.SIGCONT)
        if job_id is not None:
            api = Api(base, "operator", password)
            api.call("POST", f"/api/v1/jobs/{job_id}/commands", {"kind": "stop"})
            deadline = time.time() + 90  # the worker stops the job's processes (they outlive serve otherwise)
            while time.time() < deadline and api.call("GET", f"/api/v1/jobs/{job_id}")[1].get("status") in (
                    "pending", "launching", "running", "recovering"):
                time.sleep(1)
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(timeout=30)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()
        out.close()
