"""compute_goodput: the parts of wall time add up to it, and each part comes from its facts."""

from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.jobs.goodput import PARTS, compute_goodput

from .factories import make_checkpoint, make_cycle, make_job, make_rank

pytestmark = pytest.mark.django_db


def approx(v):
    """Times come from the database as epoch floats (SQLite: julianday, ~0.1 ms precision)."""
    return pytest.approx(v, abs=1e-3)


def assert_adds_up(g):
    assert sum(g[k] for k in PARTS) == pytest.approx(1.0)
    assert sum(g[f"{k}_s"] for k in PARTS) == pytest.approx(g["wall_s"])
    assert all(g[k] >= 0 for k in PARTS)


def test_it_splits_a_clean_run_into_startup_and_productive():
    now = timezone.now()
    job = make_job(now=now, age_s=110, last_step=100)  # first step 10 s after start
    make_rank(job, 0, now=now, step_time_s=1.0)
    g = compute_goodput(job, now)
    assert_adds_up(g)
    assert g["wall_s"] == approx(110)
    assert g["startup_s"] == approx(10)
    assert g["productive_s"] == approx(100)
    assert g["goodput"] == approx(100 / 110)
    assert g["idle_s"] == approx(0)


def test_it_counts_recovery_lost_work_and_blocking():
    now = timezone.now()
    job = make_job(now=now, age_s=210, last_step=100)
    start = job.first_step_at  # now - 200 s
    make_rank(job, 0, now=now, step_time_s=1.0)
    make_checkpoint(job, 20, started_at=start + timedelta(seconds=20), blocking_s=2.0)
    make_checkpoint(job, 40, started_at=start + timedelta(seconds=40), blocking_s=3.0, mode="sync")
    # 5 s recovery, 15 steps lost (fault at 55, resumed from 40)
    make_cycle(
        job,
        "c1",
        fault_at=start + timedelta(seconds=60),
        marks=(0.5, 1, 2, 4, 5),
        step_at_fault=55,
        resumed_from_step=40,
    )
    g = compute_goodput(job, now)
    assert_adds_up(g)
    assert g["startup_s"] == approx(10)
    assert g["checkpoint_blocking_s"] == approx(5)
    assert g["recovery_s"] == approx(5)
    assert g["productive_s"] == approx(100)
    assert g["lost_work_s"] == approx(15)
    assert g["idle_s"] == approx(210 - 10 - 5 - 5 - 100 - 15)


def test_it_adds_up_when_the_facts_overlap_or_exceed_wall_time():
    now = timezone.now()
    job = make_job(now=now, age_s=60, last_step=500)
    start = job.first_step_at
    make_rank(job, 0, now=now, step_time_s=5.0)  # claims more step time than there is wall time
    make_checkpoint(job, 10, started_at=start + timedelta(seconds=1), blocking_s=500.0, mode="sync")
    make_cycle(job, "c1", fault_at=start + timedelta(seconds=5), marks=(1, 2, 3, 4, 30))
    make_cycle(job, "c2", fault_at=start + timedelta(seconds=10), marks=(1, 2, 3, 4, 20))  # nested in c1
    g = compute_goodput(job, now)
    assert_adds_up(g)
    assert g["recovery_s"] <= 30 + 1e-6


def test_it_counts_an_open_cycle_until_now_and_its_expected_loss():
    now = timezone.now()
    job = make_job(now=now, age_s=110, last_step=50)
    start = job.first_step_at
    make_checkpoint(job, 40, started_at=start + timedelta(seconds=40), blocking_s=0.0)
    make_cycle(job, "open", fault_at=now - timedelta(seconds=20), marks=(1, None), step_at_fault=50)
    g = compute_goodput(job, now)
    assert_adds_up(g)
    assert g["recovery_s"] == approx(20)
    # no measured step time: training time 80 s over 50 counted + 10 lost steps
    assert g["lost_work_s"] == approx(80 * 10 / 60)


def test_it_uses_the_job_end_for_a_finished_job():
    now = timezone.now()
    job = make_job(
        now=now, age_s=100, finished_at=now - timedelta(seconds=50), status="succeeded", last_step=40
    )
    g = compute_goodput(job, now)
    assert g["wall_s"] == approx(50)
    assert_adds_up(g)


def test_it_is_all_startup_before_the_job_starts():
    now = timezone.now()
    job = make_job(
        now=now, status="pending", started_at=None, first_step_at=None, created_at=now, last_step=0
    )
    g = compute_goodput(job, now)
    assert g["startup"] == 1.0 and g["goodput"] == 0.0
    assert_adds_up(g)


def test_it_is_what_job_goodput_returns():
    now = timezone.now()
    job = make_job(now=now)
    assert job.goodput(now) == compute_goodput(job, now)
