"""The watchdog: controlplane.jobs.supervision (lost, stalled, restart storms) and its Celery task."""

import threading
import time
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from controlplane.jobs import heartbeats, ingestion, supervision, tasks
from controlplane.jobs.launcher_port import launcher_requested
from controlplane.jobs.models import Command, Fault, Job, Notification, Rank, RestartCycle
from tests.controlplane.conftest import batch, hb, make_job, needs_postgres, needs_redis
from trainer.wire import parse_batch

pytestmark = pytest.mark.django_db


def beat(job, *beats):
    b = parse_batch(batch(list(beats)), now=time.time(), world_size=job.world_size)
    ingestion.record_batch(job, b, now=timezone.now())


def later(seconds):
    return timezone.now() + timedelta(seconds=seconds)


def lost_faults(job):
    return Fault.objects.filter(job=job, fault_class="heartbeat_lost")


def test_it_records_a_lost_rank_once(settle):
    job, _ = make_job(spec={"step_timeout_s": 10.0})
    t = time.time()
    beat(job, hb(0, 5, at=t), hb(1, 5, at=t))
    settle()
    assert supervision.mark_overdue(later(5)) == 0
    beat(job, hb(0, 6, at=t + 1))  # rank 0 keeps beating (here: its deadline moves to t + 11)
    assert supervision.mark_overdue(later(10.5)) == 1
    assert supervision.mark_overdue(later(10.6)) == 0
    fault = lost_faults(job).get()
    assert fault.rank == 1 and fault.detected_by == "watchdog"
    assert fault.at.timestamp() == pytest.approx(t, abs=1e-3)
    assert Rank.objects.get(job=job, rank=1).lost_at is not None


def test_it_gives_a_saving_rank_the_checkpoint_timeout(settle):
    job, _ = make_job(spec={"step_timeout_s": 10.0, "checkpoint_timeout_s": 100.0})
    beat(job, hb(0, 5, "checkpoint_save"), hb(1, 5, "stopped"))
    settle()
    assert supervision.mark_overdue(later(50)) == 0
    assert supervision.mark_overdue(later(101)) == 1
    assert lost_faults(job).get().rank == 0


def test_it_forgets_the_claim_when_the_rank_beats_again_and_catches_the_next_loss(settle):
    job, _ = make_job(spec={"step_timeout_s": 10.0})
    t = time.time() - 30
    beat(job, hb(0, 5, at=t))
    settle()
    assert supervision.mark_overdue() == 1
    beat(job, hb(0, 6, at=time.time()))
    settle()
    assert Rank.objects.get(job=job, rank=0).lost_at is None
    assert supervision.mark_overdue() == 0
    assert supervision.mark_overdue(later(11)) == 1
    assert lost_faults(job).count() == 2


def test_it_does_not_revive_a_lost_rank_for_a_late_replay_of_an_old_beat(settle):
    job, _ = make_job(spec={"step_timeout_s": 10.0})
    t = time.time() - 60
    beat(job, hb(0, 5, at=t))
    settle()
    assert supervision.mark_overdue() == 1
    beat(job, hb(0, 5, at=t + 1))  # spooled, sent long after
    settle()
    assert supervision.mark_overdue() == 0
    assert lost_faults(job).count() == 1


def test_it_ignores_ranks_of_finished_jobs(settle):
    job, _ = make_job(spec={"step_timeout_s": 10.0}, status="succeeded")
    beat(job, hb(0, 5, at=time.time() - 60))
    settle()
    assert supervision.mark_overdue() == 0


def test_it_catches_up_after_the_workers_were_down(settle):
    job, _ = make_job(spec={"step_timeout_s": 10.0})
    beat(job, hb(0, 5, at=time.time() - 30), hb(1, 5, at=time.time() - 30))
    settle()
    # No watchdog ran while the deadline passed; the first pass after the restart records each loss once.
    assert supervision.mark_overdue(later(3600)) == 2
    assert supervision.mark_overdue(later(3601)) == 0
    assert lost_faults(job).count() == 2


def test_a_pass_at_a_rank_s_exact_deadline_leaves_it_to_the_next_pass(settle, hb_store):
    """A deadline equal to ``now`` has not passed (``Rank.health_at``), though the Redis store's deadline
    index returns it (deadlines <= now): the rank must stay indexed, so the next pass finds it lost, not
    the database scan a ``backstop_grace_s`` (15 s) later."""
    job, _ = make_job(spec={"step_timeout_s": 10.0})
    t = float(int(time.time()) - 30)  # whole seconds: the index's score and the row's deadline are equal
    beat(job, hb(0, 5, at=t))
    settle()
    deadline = Rank.objects.get(job=job, rank=0).stale_at
    assert deadline.timestamp() == t + 10
    assert [e[:2] for e in hb_store.overdue(deadline)] in ([], [(job.pk, 0)])  # [] for the database store
    assert supervision.mark_overdue(deadline) == 0
    assert supervision.mark_overdue(deadline + timedelta(seconds=1)) == 1


@needs_redis()
def test_it_detects_a_lost_rank_from_redis_before_any_flush(hb_store):
    job, _ = make_job(spec={"step_timeout_s": 10.0})
    t = time.time()
    beat(job, hb(0, 5, at=t), hb(1, 5, at=t))
    assert not Rank.objects.filter(job=job).exists()  # nothing flushed yet
    assert supervision.mark_overdue(later(11), store=hb_store) == 2
    assert lost_faults(job).count() == 2
    assert not Rank.objects.filter(job=job).exists()  # the rows are the flush's to write, not the watchdog's
    assert len(hb_store.overdue(later(11))) == 2  # kept until the rows can be claimed
    assert supervision.mark_overdue(later(11.5), store=hb_store) == 0  # recorded once
    hb_store.flush()
    assert supervision.mark_overdue(later(12), store=hb_store) == 0
    assert Rank.objects.filter(job=job, lost_at__isnull=False).count() == 2  # claimed, no second fault
    assert lost_faults(job).count() == 2
    assert hb_store.overdue(later(12)) == []  # settled entries leave the index


@needs_redis()
def test_it_does_not_claim_a_rank_that_beat_after_the_last_flush(hb_store):
    job, _ = make_job(spec={"step_timeout_s": 10.0})
    t = time.time() - 30
    beat(job, hb(0, 5, at=t))
    hb_store.flush()
    beat(job, hb(0, 6, at=time.time()))  # only in Redis: the row still says t (a flush is overdue)
    assert Rank.objects.get(job=job, rank=0).stale_at.timestamp() == pytest.approx(t + 10, abs=1e-3)
    assert supervision.mark_overdue(store=hb_store) == 0  # the row is overdue, Redis says alive
    assert not lost_faults(job).exists()
    row = Rank.objects.get(job=job, rank=0)
    assert (row.last_step, row.lost_at) == (5, None)  # the watchdog wrote nothing: the next flush does


@needs_redis()
def test_it_keeps_watching_from_the_database_when_redis_is_down(settle):
    job, _ = make_job(spec={"step_timeout_s": 10.0})
    beat(job, hb(0, 5, at=time.time() - 30))
    settle()
    down = heartbeats.RedisHeartbeatStore("redis://127.0.0.1:1/0")
    assert supervision.mark_overdue(store=down) == 1


def test_it_marks_a_stalled_rank_once_and_notifies_once(settle):
    job, _ = make_job(spec={"stall_timeout_s": 60.0, "step_timeout_s": 600.0}, notify_webhook_url="http://x.test/h")
    t = time.time() - 100
    beat(job, hb(0, 7, at=t), hb(1, 7, at=t))
    settle()  # (with Redis the step clock is as exact as the flush interval)
    beat(job, hb(0, 7, at=time.time()), hb(1, 7, at=time.time()))  # alive, same step
    settle()
    assert supervision.mark_stalled() == 2
    assert supervision.mark_stalled() == 0
    faults = Fault.objects.filter(job=job, fault_class="stalled")
    assert faults.count() == 2 and "at step 7" in faults.first().message
    n = Notification.objects.get(job=job)
    assert n.transition == "stalled" and "stuck at step 7" in n.payload["text"]
    beat(job, hb(0, 8), hb(1, 8))  # progress clears the claim
    settle()
    assert not Rank.objects.filter(job=job, stalled_at__isnull=False).exists()


def _cycles(job, n, start):
    for i in range(n):
        RestartCycle.objects.create(job=job, key=f"a0-ij0-ip{i + 1}", layer="in_process",
                                    fault_at=start + timedelta(seconds=i))


def test_it_stops_a_restart_storm(monkeypatch, django_capture_on_commit_callbacks):
    nudges = []
    monkeypatch.setattr(launcher_requested, "receivers", [])  # here, nobody carries the stop out
    launcher_requested.connect(lambda **kw: nudges.append((kw["action"], kw["job_id"], kw["command_id"])),
                               weak=False)
    job, _ = make_job(spec={"storm_restarts": 3}, notify_email="ops@example.com",
                      max_step=50, last_progress_at=timezone.now() - timedelta(minutes=5))
    _cycles(job, 2, timezone.now() - timedelta(minutes=4))
    assert supervision.stop_storms() == 0
    RestartCycle.objects.create(job=job, key="a0-ij1", layer="in_job", fault_at=timezone.now())
    with django_capture_on_commit_callbacks(execute=True):
        assert supervision.stop_storms() == 1
    job.refresh_from_db()
    assert job.status == "failed" and job.status_reason.startswith("restart storm: 3 restarts")
    # The stop is a row (the launcher's supervise pass carries it out if the nudge is lost) and a nudge.
    stop = Command.objects.get(job=job)
    assert (stop.kind, stop.via_trainer, stop.status) == ("stop", False, "pending")
    assert stop.detail.startswith("restart storm")
    assert nudges == [("stop", job.pk, stop.pk)]
    assert Notification.objects.get(job=job).transition == "storm"
    assert supervision.stop_storms() == 0


def test_it_does_not_count_restarts_before_the_last_progress():
    job, _ = make_job(spec={"storm_restarts": 3}, max_step=90, last_progress_at=timezone.now())
    _cycles(job, 5, timezone.now() - timedelta(minutes=10))
    assert supervision.stop_storms() == 0
    assert Job.objects.get(pk=job.pk).status == "running"


def test_its_tasks_are_callable_directly(settle):
    job, _ = make_job(spec={"step_timeout_s": 10.0})
    beat(job, hb(0, 5, at=time.time() - 30))
    settle()
    tasks.watchdog()
    tasks.send_notifications()
    assert lost_faults(job).count() == 1


@needs_postgres()
@pytest.mark.django_db(transaction=True)
def test_two_concurrent_watchdogs_record_one_fault(settle):
    job, _ = make_job(spec={"step_timeout_s": 10.0})
    beat(job, *[hb(r, 5, at=time.time() - 30) for r in range(4)])
    settle()
    barrier = threading.Barrier(2)
    results = []

    def run():
        try:
            barrier.wait()
            results.append(supervision.run_watchdog())
        finally:
            connection.close()

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.lost for r in results) in ([0, 4], [1, 3], [2, 2])  # split any way, never doubled
    assert lost_faults(job).count() == 4
    assert Fault.objects.filter(job=job).values("rank").distinct().count() == 4


def test_the_beat_schedule_runs_every_periodic_task():
    from django.conf import settings

    from controlplane.celery import app

    app.loader.import_default_modules()
    scheduled = {e["task"]: e["schedule"] for e in settings.CELERY_BEAT_SCHEDULE.values()}
    assert scheduled["controlplane.jobs.tasks.flush_heartbeats"] == settings.HEARTBEAT_FLUSH_INTERVAL_S
    assert scheduled["controlplane.jobs.tasks.watchdog"] == settings.WATCHDOG_INTERVAL_S
    periodic = {"controlplane.jobs.tasks.watchdog", "controlplane.jobs.tasks.flush_heartbeats",
                "controlplane.jobs.tasks.send_notifications", "controlplane.launchers.tasks.supervise"}
    assert set(scheduled) == periodic
    assert periodic <= set(app.tasks)

