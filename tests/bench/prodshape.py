"""The production shape the ingest benchmarks run against, and how they measure it.

Shared by ``make bench-ingest`` (tests/bench/bench_ingest.py) and ``make bench-fleet``
(tests/bench/bench_fleet.py): PostgreSQL via ``DATABASE_URL`` and Redis via ``REDIS_URL`` (databases of
the bench's own by default: its Celery queues and heartbeat keys must not meet a dev server's); the
production ASGI server (``uvicorn controlplane.asgi:application``: uvloop, httptools, no access log,
``UNBROKEN_DEBUG=false``); a Celery worker with beat (the settings' schedule: the watchdog every
``WATCHDOG_INTERVAL_S``, the heartbeat flush every ``HEARTBEAT_FLUSH_INTERVAL_S``); and CPU accounting of
each of them.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
DEFAULT_DB = "postgres://postgres@127.0.0.1:5432/unbroken_bench"
DEFAULT_REDIS = "redis://127.0.0.1:6379/9"
# The production app: Django with the ingest fast path in front (controlplane/ingest/asgi.py).
ASGI_APP = "controlplane.asgi:application"


def bench_env(tmp: Path, *, db: str = DEFAULT_DB, redis: str = DEFAULT_REDIS) -> dict[str, str]:
    """The environment of every process of the bench (this one included: ``os.environ`` is updated).
    ``DATABASE_URL`` and ``REDIS_URL`` win over ``db`` and ``redis``, the bench's own databases."""
    env = {**os.environ, "DATABASE_URL": os.environ.get("DATABASE_URL") or db,
           "REDIS_URL": os.environ.get("REDIS_URL") or redis, "UNBROKEN_DEBUG": "false",
           "UNBROKEN_SECRET_KEY": secrets.token_urlsafe(50), "UNBROKEN_DATA_DIR": str(tmp),
           "UNBROKEN_LOG_LEVEL": "WARNING", "PYTHONPATH": str(ROOT), "DJANGO_SETTINGS_MODULE": "controlplane.settings"}
    os.environ.update(env)
    return env


def prepare(env: dict[str, str], *, own_redis: str = DEFAULT_REDIS) -> None:
    """Create and migrate the database, set Django up in this process, clear the bench's Redis keys."""
    ensure_database(env["DATABASE_URL"])
    subprocess.run([PY, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT, env=env, check=True)
    import django

    django.setup()
    import redis

    r = redis.Redis.from_url(env["REDIS_URL"])
    if env["REDIS_URL"] == own_redis:
        r.flushdb()  # the bench's own database
    else:
        for key in r.scan_iter("ubk:hb:*", count=1000):
            r.delete(key)


def ensure_database(url: str) -> None:
    from urllib.parse import urlparse

    import psycopg

    u = urlparse(url)
    name = u.path.lstrip("/")
    admin = url.replace(f"/{name}", "/postgres", 1) if name else url
    with psycopg.connect(admin, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')


def start_server(env: dict[str, str], port: int, *, workers: int) -> subprocess.Popen:
    return subprocess.Popen(
        [PY, "-m", "uvicorn", ASGI_APP, "--host", "127.0.0.1", "--port", str(port),
         "--workers", str(workers), "--loop", "uvloop", "--http", "httptools", "--no-access-log",
         "--log-level", "warning", "--backlog", "2048"],
        cwd=ROOT, env=env, start_new_session=True)


def start_worker(env: dict[str, str], beat_schedule_file: Path, *, concurrency: int) -> subprocess.Popen:
    """A Celery worker with beat on the default and launch queues."""
    return subprocess.Popen(
        [PY, "-m", "celery", "-A", "controlplane", "worker", "-B", "-Q", "default,launch", "-c",
         str(concurrency), "--loglevel", "WARNING", "-s", str(beat_schedule_file),
         "--without-gossip", "--without-mingle", "--without-heartbeat"],
        cwd=ROOT, env=env, start_new_session=True)


def wait_http(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"the server did not answer {url} within {timeout_s:.0f} s")


def stop(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """Stop a process group this script started (by its own pid)."""
    if proc.poll() is not None:
        return
    try:
        proc.terminate()  # the server or worker stops its own children
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def cpu_seconds(pids: list[int], *, children: bool = True) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        try:
            p = psutil.Process(pid)
            for q in [p, *(p.children(recursive=True) if children else [])]:
                t = q.cpu_times()
                total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def machine_busy() -> float:
    """Whole-machine CPU use since the last call, in % of all cores (other users included)."""
    import psutil

    return psutil.cpu_percent(interval=None)


def server_cpu(name: str) -> dict[int, float]:
    """CPU seconds so far of each process of a shared server (redis-server, postgres), by pid.

    Their CPU includes other clients' work. Postgres forks a backend per connection, so compare two
    of these with ``cpu_since`` (a backend that appears in between counts from zero).
    """
    import psutil

    out = {}
    for p in psutil.process_iter(["name", "cpu_times"]):
        if (p.info["name"] or "").startswith(name) and p.info["cpu_times"] is not None:
            out[p.pid] = p.info["cpu_times"].user + p.info["cpu_times"].system
    return out


def cpu_since(before: dict[int, float], after: dict[int, float]) -> float:
    return sum(v - before.get(pid, 0.0) for pid, v in after.items())
