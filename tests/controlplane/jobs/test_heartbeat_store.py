"""The Redis heartbeat store's record script: what it keeps, straight from Redis (no flush)."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import pytest

from controlplane.jobs.heartbeats import Timeouts
from tests.controlplane.conftest import hb, make_job, needs_redis

pytestmark = [pytest.mark.django_db, needs_redis()]

TIMEOUTS = Timeouts(step_s=10.0, checkpoint_s=300.0, stall_s=120.0)
NOW = datetime.now(tz=UTC)


def test_it_keeps_each_ranks_newest_beat_whatever_the_order(hb_store):
    job, _ = make_job(spec={"procs_per_node": 8})
    t = time.time()
    # Out of order inside one batch, then an older batch after a newer one.
    hb_store.record(job.pk, [hb(0, 7, at=t + 2), hb(0, 5, at=t), hb(1, 3, at=t)], TIMEOUTS, now=NOW)
    hb_store.record(job.pk, [hb(0, 4, at=t + 1), hb(1, 4, at=t + 1)], TIMEOUTS, now=NOW)
    got = hb_store.freshest(job.pk, [0, 1])
    assert (got[0].step, got[0].at) == (7, t + 2)
    assert (got[1].step, got[1].at) == (4, t + 1)


def test_it_keeps_strings_that_look_like_its_own_separators(hb_store):
    job, _ = make_job(spec={"procs_per_node": 8})
    odd = 'n[1,2]\n|"x",}{"rank":9},{"' + '}'
    hb_store.record(job.pk, [hb(3, 1, node=odd, loss=1e-30, pid=7), hb(4, 1, node="plain")], TIMEOUTS, now=NOW)
    got = hb_store.freshest(job.pk, [3, 4])
    assert got[3].node == odd and got[3].loss == 1e-30 and got[3].pid == 7
    assert got[4].node == "plain"


def test_deadlines_follow_the_phase_and_a_stopped_rank_has_none(hb_store):
    job, _ = make_job(spec={"procs_per_node": 8})
    t = time.time() - 1000
    hb_store.record(job.pk, [hb(0, 1, at=t), hb(1, 1, phase="checkpoint_save", at=t), hb(2, 1, at=t)],
                    TIMEOUTS, now=NOW)
    hb_store.record(job.pk, [hb(2, 1, phase="stopped", at=t + 1)], TIMEOUTS, now=NOW)
    deadlines = {r: d for _, r, d in hb_store.overdue(datetime.now(tz=UTC))}
    assert deadlines == {0: pytest.approx(t + 10), 1: pytest.approx(t + 300)}


def test_an_empty_batch_writes_nothing(hb_store):
    job, _ = make_job()
    hb_store.record(job.pk, [], TIMEOUTS, now=NOW)
    assert hb_store.redis.exists(*hb_store.keys(job.pk)) == 0


def test_a_flush_in_slices_writes_every_rank_and_the_jobs_progress(hb_store):
    from controlplane.jobs.models import Job, Rank

    job, _ = make_job(spec={"procs_per_node": 3000})
    hb_store.FLUSH_SLICE, hb_store.FLUSH_DUTY = 400, 1.0  # several HSCAN steps, no pauses
    t = time.time()
    for lo in range(0, 3000, 500):
        hb_store.record(job.pk, [hb(r, 10 + r % 7, at=t) for r in range(lo, lo + 500)], TIMEOUTS, now=NOW)
    assert hb_store.flush() == 3000
    assert Rank.objects.filter(job=job).count() == 3000
    assert set(Rank.objects.filter(job=job).values_list("rank", "last_step")) == {
        (r, 10 + r % 7) for r in range(3000)}
    job = Job.objects.get(pk=job.pk)
    assert job.max_step == 16


def test_a_new_job_does_not_inherit_state_left_under_its_id(hb_store):
    """The database was reset (or restored) while Redis kept its keys: the next job gets an id that was
    used before, and the old job's progress (step 70) must not make the new one look stuck below it."""
    from controlplane.jobs import services
    from controlplane.jobs.spec import JobSpec

    before, _ = make_job()
    reused = before.pk + 1
    hb_store.record(reused, [hb(0, 70), hb(1, 70)], TIMEOUTS, now=NOW)
    assert hb_store.progress(reused)[0][0] == 70
    job = services.create_job(name="next", spec=JobSpec(), created_by=None, launch=False)
    assert job.pk == reused, "the test needs the id the stale state was left under"
    assert hb_store.progress(job.pk) == (None, None)
    assert hb_store.freshest(job.pk, [0, 1]) == {}
