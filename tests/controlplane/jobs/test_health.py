"""controlplane.jobs.rank_health: a rank's row moved forward to the store's newest beat is exactly the row the
flush then writes (the upsert's rules, said twice: this test holds them together)."""

import time
from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.jobs import ingestion, rank_health
from controlplane.jobs.models import Rank
from tests.controlplane.conftest import batch, hb, make_job, needs_redis
from trainer.wire import parse_batch

pytestmark = pytest.mark.django_db
FIELDS = ("node", "pid", "phase", "last_heartbeat_at", "last_step", "step_changed_at", "loss", "step_time_s",
          "tokens_per_s", "stale_at", "stall_at", "lost_at", "stalled_at")


def beat(job, *beats):
    ingestion.record_batch(job, parse_batch(batch(list(beats)), now=time.time(), world_size=job.world_size),
                           now=timezone.now())


@needs_redis()
@pytest.mark.parametrize("second", [
    {"step": 5},  # the step held: the step clock and the stall deadline keep their start
    {"step": 6},  # progress: a new step clock, the stall claim cleared
    {"step": 5, "phase": "checkpoint_save"},  # a slow phase: the checkpoint timeout, no stall deadline
    {"step": 6, "phase": "stopped"},  # stopped: no deadline at all
])
def test_the_view_is_the_row_the_flush_writes(hb_store, second):
    job, _ = make_job(spec={"step_timeout_s": 10.0, "stall_timeout_s": 60.0, "procs_per_node": 1})
    t = time.time() - 100
    beat(job, hb(0, 5, at=t, node="n0", pid=7, loss=2.0))
    hb_store.flush()
    Rank.objects.filter(job=job).update(lost_at=timezone.now(), stalled_at=timezone.now())  # old claims
    row = Rank.objects.get(job=job, rank=0)
    beat(job, hb(0, at=time.time(), node="n0", pid=7, loss=1.5, **second))
    now = timezone.now()
    view = rank_health.current(row, hb_store.freshest(job.pk, [0])[0], job.timeouts, now)
    hb_store.flush(now=now)
    written = Rank.objects.get(job=job, rank=0)
    for f in FIELDS:
        a, b = getattr(view, f), getattr(written, f)
        if hasattr(a, "timestamp") and b is not None:
            assert a.timestamp() == pytest.approx(b.timestamp(), abs=1e-5), f
        else:
            assert a == b, f
    assert row.last_step == 5 and row.lost_at is not None  # the row itself is untouched


def test_an_older_beat_changes_nothing():
    job, _ = make_job(spec={"procs_per_node": 1})
    row = Rank(job=job, rank=0, last_heartbeat_at=timezone.now(), last_step=9)
    from controlplane.jobs.heartbeats import RankState

    old = RankState(rank=0, at=(timezone.now() - timedelta(seconds=5)).timestamp(), step=3, phase="train")
    assert rank_health.current(row, old, job.timeouts, timezone.now()) is row
