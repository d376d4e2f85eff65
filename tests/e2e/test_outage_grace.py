"""Outage grace end to end: a real ``manage.py serve`` (embedded defaults in a fresh data dir) runs a
2-rank job; ingest is stopped (SIGSTOP to the web) for longer than the job's step timeout; the job
finishes with no ``heartbeat_lost`` fault and the outage is on record (the timeline draws it:
tests/controlplane/jobs/test_outages.py)."""

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

from bench_chaos import Api, health, wait_for  # noqa: E402
from trainer.ports import free_port  # noqa: E402

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
    serve = subprocess.Popen([sys.executable, "manage.py", "serve", "--port", str(port), "--web-workers", "1"],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    web = None
    try:
        wait_for(lambda: (h := health(base)) and len(h) == 3, 90, "serve's three children")
        api = Api(base, "operator", password)
        status, body = api.call("POST", "/api/v1/jobs", {"name": "grace", "spec": {
            "preset": "tiny", "steps": 150, "procs_per_node": 2, "checkpoint_interval": 20,
            "step_timeout_s": STEP_TIMEOUT_S, "heartbeat_interval_s": 0.5}})
        assert status == 201, body
        job_id = body["id"]

        def job() -> dict:
            return api.call("GET", f"/api/v1/jobs/{job_id}")[1]

        wait_for(lambda: job().get("status") == "running" and job().get("last_step", 0) >= 5, 180, "training")
        web = int(health(base)["web"]["pid"])
        os.killpg(web, signal.SIGSTOP)
        time.sleep(3 * STEP_TIMEOUT_S)
        os.killpg(web, signal.SIGCONT)
        web = None
        final = wait_for(lambda: (j := job()).get("status") in ("succeeded", "failed", "stopped") and j, 600,
                         "the job to finish")
        assert final["status"] == "succeeded", final
        db = sqlite3.connect(tmp_path / "unbroken.sqlite3")
        faults = db.execute("SELECT fault_class, message FROM jobs_fault WHERE job_id = ?", [job_id]).fetchall()
        assert faults == []
        spans = db.execute("SELECT started_at, ended_at FROM jobs_outage WHERE component = 'ingest'").fetchall()
        assert len(spans) == 1 and spans[0][1] is not None
    finally:
        if web is not None:
            os.killpg(web, signal.SIGCONT)
        serve.send_signal(signal.SIGTERM)
        try:
            serve.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.communicate()
