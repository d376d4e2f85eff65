"""One rule for a rank's health: the dashboard's rank table and the watchdog judge a rank the same way,
by its row moved forward to the heartbeat store's newest beat (controlplane.jobs.rank_health)."""

import time
from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.dashboard.parts import rank_table
from controlplane.jobs import ingestion, supervision
from controlplane.jobs.models import Fault, Rank
from tests.controlplane.conftest import batch, hb, make_job, needs_redis
from trainer.wire import parse_batch

pytestmark = pytest.mark.django_db


def beat(job, *beats):
    ingestion.record_batch(job, parse_batch(batch(list(beats)), now=time.time(), world_size=job.world_size),
                           now=timezone.now())


def table_health(job, now):
    job = type(job).objects.get(pk=job.pk)  # a fresh instance: lanes are cached per request
    return {row["rank"]: (row["health"], row.get("step")) for row in rank_table.ranks_part(job, now)["rows"]}


@needs_redis()
def test_a_rank_that_beat_after_the_last_flush_is_alive_for_both(hb_store):
    job, _ = make_job(spec={"step_timeout_s": 10.0, "procs_per_node": 2})
    t = time.time() - 30
    beat(job, hb(0, 5, at=t), hb(1, 5, at=t))
    hb_store.flush()
    beat(job, hb(0, 6, at=time.time()))  # only in Redis: rank 0's row still says it is overdue
    now = timezone.now()
    assert Rank.objects.get(job=job, rank=0).health_at(now) == "lost"  # the lagging row alone
    assert table_health(job, now) == {0: ("ok", 6), 1: ("lost", 5)}
    assert supervision.mark_overdue(now, store=hb_store) == 1
    assert list(Fault.objects.filter(job=job).values_list("rank", flat=True)) == [1]


@needs_redis()
def test_a_rank_lost_before_any_flush_is_lost_for_both(hb_store):
    job, _ = make_job(spec={"step_timeout_s": 10.0, "procs_per_node": 1})
    beat(job, hb(0, 3, at=time.time()))
    later = timezone.now() + timedelta(seconds=11)
    assert not Rank.objects.filter(job=job).exists()
    assert table_health(job, later) == {0: ("lost", 3)}
    assert supervision.mark_overdue(later, store=hb_store) == 1
