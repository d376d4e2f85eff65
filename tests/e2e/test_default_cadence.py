"""The embedded default keeps its periodic work on time: a real ``manage.py serve`` (SQLite, Celery on
kombu's filesystem transport, no ``DATABASE_URL`` / ``REDIS_URL``) runs idle for a few minutes and
records no outage: every watchdog pass comes within ``outages.watchdog_gap_s()`` of the one before,
and the broker's folder does not grow (the worker takes messages as fast as beat puts them).

Before the fix (``CELERY_WORKER_PREFETCH_MULTIPLIER`` in settings) this recorded a "watchdog did not
run for 6.1 s" outage every ~24 s and a backlog that grew by ~2 messages a second."""

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

from bench_chaos import health, wait_for  # noqa: E402

pytestmark = pytest.mark.slow
RUN_S = float(os.environ.get("UNBROKEN_TEST_CADENCE_S", "180"))


def test_it_records_no_outage_while_the_default_setup_runs_for_minutes(tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATABASE_URL", "REDIS_URL", "UNBROKEN_SECRET_KEY_FILE")}
    env.update(UNBROKEN_DATA_DIR=str(tmp_path), UNBROKEN_SECRET_KEY=secrets.token_urlsafe(40),
               UNBROKEN_PUBLIC_URL=base, PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT, env=env,
                   check=True, stdout=subprocess.DEVNULL)
    out = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - closed at the end
    serve = subprocess.Popen([sys.executable, "manage.py", "serve", "--port", str(port),
                              "--web-workers", "1"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    db = sqlite3.connect(tmp_path / "unbroken.sqlite3", timeout=30)
    try:
        wait_for(lambda: (h := health(base)) and len(h) == 3, 90, "serve's three children")

        def beacon() -> float | None:
            row = db.execute("SELECT (julianday('now') - julianday(at)) * 86400 FROM jobs_beacon "
                             "WHERE name = 'watchdog'").fetchone()
            return row[0] if row else None

        wait_for(lambda: beacon() is not None, 60, "the first watchdog pass")
        backlog = []
        deadline = time.time() + RUN_S
        while time.time() < deadline:
            time.sleep(10)
            backlog.append(len(os.listdir(tmp_path / "broker" / "in")))
        outages = db.execute("SELECT component, started_at, ended_at, detail FROM jobs_outage").fetchall()
        assert outages == [], (outages, (tmp_path / "serve.log").read_text()[-3000:])
        assert beacon() < 5.0
        assert max(backlog[len(backlog) // 2:]) <= 10, backlog  # beat's ~3 messages a second are taken
    finally:
        db.close()
        serve.send_signal(signal.SIGTERM)  # serve stops its children (each in its own process group)
        try:
            serve.wait(timeout=30)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()
        out.close()
