"""Shared fixtures and factories for control-plane tests.

Factories are plain functions: ``make_job(**overrides) -> (job, token)``, ``batch(...)``, ``hb(...)``.
The heartbeat store follows the environment: with ``REDIS_URL`` set, tests run the Redis store (under a
per-test key prefix, removed afterwards); without it, the database store. ``settle()`` makes ``Rank``
rows current (a flush with Redis, nothing with the database store).
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from urllib.parse import urlparse

import pytest

from controlplane.jobs import heartbeats

REDIS_URL = os.environ.get("REDIS_URL", "")
DATABASE_URL = os.environ.get("DATABASE_URL", "")


def reachable(url: str, default_port: int) -> bool:
    if not url:
        return False
    u = urlparse(url)
    try:
        with socket.create_connection((u.hostname or "127.0.0.1", u.port or default_port), timeout=1):
            return True
    except OSError:
        return False


def needs_postgres():
    """Skip unless the tests run against PostgreSQL (DATABASE_URL set and the server reachable)."""
    return pytest.mark.skipif(
        not (DATABASE_URL.startswith("postgres") and reachable(DATABASE_URL, 5432)),
        reason="needs PostgreSQL: set DATABASE_URL=postgres://postgres@127.0.0.1:5432/test with the server up")


def needs_redis():
    return pytest.mark.skipif(
        not reachable(REDIS_URL, 6379),
        reason="needs Redis: set REDIS_URL=redis://127.0.0.1:6379/0 with the server up")


def make_job(*, spec: dict | None = None, status: str = "running", **overrides):
    """A job with a fresh ingest token; returns (job, token)."""
    from controlplane.jobs.models import Job
    from controlplane.jobs.spec import JobSpec
    from trainer.jobspec import IN_PROCESS_HARD_TIMEOUT_S

    defaults: dict = {"procs_per_node": 4}
    if (spec or {}).get("step_timeout_s", 30.0) <= IN_PROCESS_HARD_TIMEOUT_S:
        # A short step timeout (quick supervision tests) is one the in-process layer would outlast: the spec
        # refuses it with in-process restarts on, so these jobs have them off.
        defaults["in_process"] = False
    full = JobSpec(**{**defaults, **(spec or {})}).to_dict()
    job = Job(name=overrides.pop("name", "test-job"), spec=full, status=status, **overrides)
    token = job.issue_token()
    job.save()
    return job, token


def hb(rank: int = 0, step: int = 1, phase: str = "train", at: float | None = None, **extra) -> dict:
    return {"rank": rank, "step": step, "phase": phase, "at": time.time() if at is None else at, **extra}


def ev(eid: str, kind: str, data: dict | None = None, at: float | None = None, rank: int | None = None) -> dict:
    out = {"id": eid, "kind": kind, "at": time.time() if at is None else at, "data": data or {}}
    if rank is not None:
        out["rank"] = rank
    return out


def batch(heartbeats_: list | None = None, events: list | None = None, sent_at: float | None = None, **extra) -> dict:
    return {"v": 1, "sent_at": time.time() if sent_at is None else sent_at, "source": "test",
            "heartbeats": heartbeats_ or [], "events": events or [], **extra}


@pytest.fixture(autouse=True)
def _fresh_caches():
    from controlplane.ingest import views

    views.clear_caches()
    yield
    views.clear_caches()


@pytest.fixture(autouse=True)
def hb_store():
    """The heartbeat store under test (Redis when REDIS_URL is reachable, else the database)."""
    if reachable(REDIS_URL, 6379):
        store = heartbeats.RedisHeartbeatStore(REDIS_URL, prefix=f"ubk:test:{uuid.uuid4().hex[:12]}")
    else:
        store = heartbeats.DbHeartbeatStore()
    heartbeats.set_store(store)
    yield store
    heartbeats.set_store(None)
    if isinstance(store, heartbeats.RedisHeartbeatStore):
        keys = list(store.redis.scan_iter(f"{store.prefix}:*", count=1000))
        if keys:
            store.redis.delete(*keys)


@pytest.fixture
def settle(hb_store):
    """Make Rank rows and job progress current (flush the Redis store; nothing for the database)."""
    return lambda: hb_store.flush()


@pytest.fixture
def post(client):
    """POST a batch (dict, or raw bytes) to a job's ingest endpoint; returns the response."""
    import orjson

    def _post(job, token, body, **headers):
        data = body if isinstance(body, bytes) else orjson.dumps(body)
        if token is not None:
            headers.setdefault("HTTP_AUTHORIZATION", f"Bearer {token}")
        return client.post(f"/api/v1/jobs/{job.pk if hasattr(job, 'pk') else job}/ingest", data=data,
                           content_type="application/json", **headers)

    return _post
