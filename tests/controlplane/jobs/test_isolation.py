"""One job's bad heartbeat state cannot hold up another job: state planted in Redis the way an older
server (which accepted unbounded values) left it, then the real flush and watchdog."""

import json
import time
from datetime import UTC, datetime

import pytest

from controlplane.jobs import supervision
from controlplane.jobs.heartbeats import Timeouts
from controlplane.jobs.models import Fault, QuarantinedHeartbeat, Rank
from tests.controlplane.conftest import hb, make_job, needs_redis

pytestmark = [pytest.mark.django_db, needs_redis()]

TIMEOUTS = Timeouts(step_s=30.0, checkpoint_s=300.0, stall_s=120.0)


def plant(store, job_id, beats):
    """Write states as the record script of an older server did: no bounds, a deadline each."""
    state, deadlines, _ = store.keys(job_id)
    for b in beats:
        at = b["at"]
        store.redis.hset(state, str(b["rank"]), f"{at!r}|{json.dumps(b)}")
        store.redis.zadd(deadlines, {str(b["rank"]): at + 30.0})
    store.redis.sadd(store.DIRTY, job_id)
    store.redis.sadd(store.JOBS, job_id)


POISON = [
    {"rank": 0, "step": 2**63, "phase": "train", "at": time.time()},
    {"rank": 1, "step": 5, "phase": "train", "at": time.time(), "pid": 2**63},
    {"rank": 2, "step": 5, "phase": "train", "at": time.time(), "node": "a\x00b"},
    {"rank": 3, "step": 5, "phase": "train", "at": -1e12},
]


def test_a_poisoned_job_cannot_delay_another_jobs_flush(hb_store, client):
    bad, _ = make_job(name="bad")
    good, _ = make_job(name="good")
    now = datetime.now(tz=UTC)
    plant(hb_store, bad.pk, POISON)
    hb_store.record(good.pk, [hb(r, 7) for r in range(4)], TIMEOUTS, now=now)

    hb_store.flush()  # never raises

    assert sorted(Rank.objects.filter(job=good).values_list("rank", "last_step")) == [(r, 7) for r in range(4)]
    assert not Rank.objects.filter(job=bad).exists()
    q = {x.rank: x.reason for x in QuarantinedHeartbeat.objects.filter(job=bad)}
    assert set(q) == {0, 1, 2, 3}
    assert "state.step: must be <= 2147483647" in q[0] and "state.pid" in q[1]
    assert "state.node" in q[2] and "NUL" in q[2] and "state.at" in q[3]
    assert hb_store.redis.hlen(hb_store.keys(bad.pk)[0]) == 0  # out of Redis: the next flush is clean
    assert hb_store.redis.zcard(hb_store.keys(bad.pk)[1]) == 0
    assert not QuarantinedHeartbeat.objects.filter(job=good).exists()

    text = client.get("/metrics").content.decode()
    assert f'unbroken_ingest_quarantined_total{{job="{bad.pk}"}} 4.0' in text

    hb_store.record(good.pk, [hb(0, 8)], TIMEOUTS, now=now)
    hb_store.flush()
    assert Rank.objects.get(job=good, rank=0).last_step == 8
    assert QuarantinedHeartbeat.objects.filter(job=bad).count() == 4


def test_the_job_page_shows_quarantined_heartbeats(hb_store, client):
    from tests.controlplane.dashboard.factories import PASSWORD, make_user

    bad, _ = make_job(name="bad")
    plant(hb_store, bad.pk, POISON[:1])
    hb_store.flush()
    make_user("viewer")
    client.login(username="viewer", password=PASSWORD)
    page = client.get(f"/jobs/{bad.pk}/").content.decode()
    assert "Quarantined heartbeats" in page and "state.step: must be &lt;= 2147483647" in page


def test_a_poisoned_job_cannot_stop_the_watchdog_for_another_job(hb_store):
    bad, _ = make_job(name="bad")
    good, _ = make_job(name="good", spec={"step_timeout_s": 10.0})
    plant(hb_store, bad.pk, POISON)  # rank 3's deadline is long past
    old = time.time() - 100
    hb_store.record(good.pk, [hb(1, 3, at=old)], Timeouts(10.0, 300.0, 120.0), now=datetime.now(tz=UTC))

    result = supervision.run_watchdog()

    assert result.lost == 1
    assert Fault.objects.get(job=good).rank == 1
    hb_store.flush()  # the flush writes the row (quarantining the poison); the next pass claims it
    supervision.run_watchdog()
    assert Rank.objects.get(job=good, rank=1).lost_at is not None
    assert Fault.objects.filter(job=good).count() == 1
