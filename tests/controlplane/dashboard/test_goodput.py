"""compute_goodput: the parts of wall time add up to it, and each part comes from its facts."""

import random
from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.jobs.goodput import PARTS, compute_goodput
from controlplane.jobs.models import TrainingSample

from .factories import make_checkpoint, make_cycle, make_job, make_rank

pytestmark = pytest.mark.django_db


def approx(v):
    """Times come from the database as epoch floats (SQLite: julianday, ~0.1 ms precision)."""
    return pytest.approx(v, abs=1e-3)


def assert_adds_up(g):
    assert sum(g[k] for k in PARTS) == pytest.approx(1.0)
    assert sum(g[f"{k}_s"] for k in PARTS) == pytest.approx(g["wall_s"])
    assert all(g[k] >= 0 for k in PARTS)


def test_it_splits_a_clean_run_into_startup_productive_and_the_unreported_tail():
    now = timezone.now()
    job = make_job(now=now, age_s=110, last_step=100, last_progress_at=now - timedelta(seconds=2))
    make_rank(job, 0, now=now, step_time_s=1.0)
    g = compute_goodput(job, now)
    assert_adds_up(g)
    assert g["wall_s"] == approx(110)
    assert g["startup_s"] == approx(10)
    assert g["idle_s"] == approx(2)  # no step reported in the last 2 s yet
    assert g["productive_s"] == approx(98)


def test_it_counts_recovery_recomputation_and_blocking():
    now = timezone.now()
    job = make_job(now=now, age_s=210, last_step=100, max_step=100, last_progress_at=now)
    start = job.first_step_at  # now - 200 s
    make_checkpoint(job, 20, started_at=start + timedelta(seconds=20), blocking_s=2.0)
    make_checkpoint(job, 40, started_at=start + timedelta(seconds=40), blocking_s=3.0, mode="sync")
    # 5 s recovery; 15 steps lost (fault at 55, resumed from 40), passed again 12 s after the restart
    make_cycle(job, "c1", fault_at=start + timedelta(seconds=60), marks=(0.5, 1, 2, 4, 5),
               step_at_fault=55, resumed_from_step=40)
    TrainingSample.objects.create(job=job, at=start + timedelta(seconds=77), rank=0, step=56)
    g = compute_goodput(job, now)
    assert_adds_up(g)
    assert g["startup_s"] == approx(10)
    assert g["checkpoint_blocking_s"] == approx(5)
    assert g["recovery_s"] == approx(5)
    assert g["lost_work_s"] == approx(12)
    assert g["idle_s"] == approx(0)
    assert g["productive_s"] == approx(210 - 10 - 5 - 5 - 12)


def test_it_counts_the_steps_an_async_save_slowed_down_after_its_blocked_time():
    now = timezone.now()
    job = make_job(now=now, age_s=110, last_step=100, max_step=100, last_progress_at=now)
    start = job.first_step_at  # now - 100 s
    make_checkpoint(job, 20, started_at=start + timedelta(seconds=20), blocking_s=0.5, interference_s=1.5)
    make_checkpoint(job, 40, started_at=start + timedelta(seconds=40), blocking_s=2.0, mode="sync")
    # overlaps the next save's blocked time: that second goes to blocking (the earlier part)
    make_checkpoint(job, 60, started_at=start + timedelta(seconds=60), blocking_s=0.0, interference_s=4.0)
    make_checkpoint(job, 61, started_at=start + timedelta(seconds=63), blocking_s=1.0, interference_s=0.0)
    g = compute_goodput(job, now)
    assert_adds_up(g)
    assert g["checkpoint_blocking_s"] == approx(0.5 + 2.0 + 1.0)
    assert g["checkpoint_interference_s"] == approx(1.5 + 3.0)
    assert g["productive_s"] == approx(100 - 3.5 - 4.5)


def test_it_adds_up_when_the_facts_overlap_or_exceed_wall_time():
    now = timezone.now()
    job = make_job(now=now, age_s=60, last_step=500)
    start = job.first_step_at
    make_checkpoint(job, 10, started_at=start + timedelta(seconds=1), blocking_s=500.0, mode="sync")
    make_cycle(job, "c1", fault_at=start + timedelta(seconds=5), marks=(1, 2, 3, 4, 30))
    make_cycle(job, "c2", fault_at=start + timedelta(seconds=10), marks=(1, 2, 3, 4, 20))  # nested in c1
    g = compute_goodput(job, now)
    assert_adds_up(g)
    assert g["recovery_s"] <= 30 + 1e-6


def test_it_counts_an_open_cycle_until_now():
    now = timezone.now()
    job = make_job(now=now, age_s=110, last_step=50, last_progress_at=now - timedelta(seconds=21))
    make_cycle(job, "open", fault_at=now - timedelta(seconds=20), marks=(1, None), step_at_fault=50)
    g = compute_goodput(job, now)
    assert_adds_up(g)
    assert g["recovery_s"] == approx(20)
    assert g["idle_s"] == approx(1)


def test_it_holds_productive_time_while_a_save_is_in_flight():
    now = timezone.now()
    job = make_job(now=now, age_s=110, last_step=50, last_progress_at=now)
    make_checkpoint(job, 40, started_at=now - timedelta(seconds=3), state="in_flight", blocking_s=None,
                    durable_s=None)
    g = compute_goodput(job, now)
    assert g["idle_s"] == approx(3)  # its blocked time is known when it ends


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


# -- property: every moment of a generated job -----------------------------------------------------------


def _simulate(rng: random.Random) -> tuple[list[tuple], float]:
    """A job as (known at, fact, ...) events in seconds from its start: batches of steps reported by
    heartbeats (a little late, as the heartbeat store flushes), stalls, async and sync saves whose
    blocked time arrives when they end, faults whose cycle rolls back to the newest durable save (saves
    in flight are abandoned), and recomputation until the step of the fault is passed again."""
    ev: list[tuple] = []
    launched = rng.uniform(0.2, 4)  # the launch: created at 0, started (processes up) here
    ev.append((launched + rng.uniform(0, 0.5), "started", launched))
    t = launched + rng.uniform(1, 8)
    ev.append((t, "first_step", t))
    step, durable, last_sample = 0, 0, -9.0
    pending: list[list] = []  # [key, step, started, blocked, done_at, interference]
    horizon = rng.uniform(40, 120)
    n = 0
    while t < horizon:
        for p in [p for p in pending if p[4] <= t]:
            ev.append((p[4], "ckpt_done", p[0], p[4], p[3], p[5]))
            durable = max(durable, p[1])
            pending.remove(p)
        r = rng.random()
        n += 1
        if r < 0.07 and step > 0:  # a fault: recover and roll back to the newest durable save
            tf = t + rng.uniform(0, 0.3)
            first = tf + rng.uniform(0.5, 6)
            ev.append((tf + rng.uniform(0, 1), "cycle_open", f"c{n}", tf, step))
            for p in pending:
                ev.append((first, "ckpt_abandon", p[0], first))
            pending.clear()
            ev.append((first, "cycle_close", f"c{n}", first, durable))
            step, t = durable, first
        elif r < 0.11 and step > 0:  # an operator's restart: issued now, fetched and acted on later
            issued, delivered = t, t + rng.uniform(0.1, 2)
            while t < delivered:  # the loop trains on, and reports, until it acts on the command
                t += rng.uniform(0.1, 0.5)
                step += 1
                ev.append((t + rng.uniform(0, 2.5), "progress", step, t))
            first = t + rng.uniform(0.5, 4)
            ev.append((t + rng.uniform(0, 1), "command_cycle", f"c{n}", issued, delivered, t, step))
            for p in pending:
                ev.append((first, "ckpt_abandon", p[0], first))
            pending.clear()
            ev.append((first, "cycle_close", f"c{n}", first, durable))
            step, t = durable, first
        elif r < 0.15:
            t += rng.uniform(1, 8)  # a stall: no step for a while
        elif r < 0.3:  # a save: the loop blocks, then (async) the write goes on
            blocked = rng.uniform(0.0, 0.4)
            sync = rng.random() < 0.3
            done = t + blocked + (0.0 if sync else rng.uniform(0.2, 2.5))
            # async: the steps it overlapped ran slower (reported when it ends), at most its write time
            slower = 0.0 if sync else rng.choice([0.0, rng.uniform(0, done - t - blocked)])
            ev.append((t, "ckpt_start", f"s{n}", step, t, "sync" if sync else "async"))
            pending.append([f"s{n}", step, t, blocked, done, slower])
            t += blocked
        else:  # a heartbeat's worth of steps
            for _ in range(rng.randint(1, 4)):
                t += rng.uniform(0.1, 0.5)
                step += 1
            ev.append((t + rng.uniform(0, 2.5), "progress", step, t))
            if t - last_sample >= 2.0:
                ev.append((t + rng.uniform(0, 2.5), "sample", step, t))
                last_sample = t
    end = t + rng.uniform(0, 2)
    for p in pending:
        ev.append((min(p[4], end), "ckpt_done", p[0], min(p[4], end), p[3], p[5]))
    return sorted(ev, key=lambda e: e[0]), end


def _apply(job, base, e) -> None:
    from controlplane.jobs.models import Checkpoint, Job, RestartCycle

    def at(s):
        return base + timedelta(seconds=s)

    kind = e[1]
    if kind == "started":
        Job.objects.filter(pk=job.pk).update(started_at=at(e[2]))
    elif kind == "command_cycle":  # as ingest links it: fault_at is the command's issue time
        RestartCycle.objects.create(job=job, key=e[2], layer="in_process", fault_at=at(e[3]),
                                    delivered_at=at(e[4]), detected_at=at(e[5]), step_at_fault=e[6])
    elif kind == "first_step":
        Job.objects.filter(pk=job.pk).update(first_step_at=at(e[2]))
    elif kind == "progress":
        Job.objects.filter(pk=job.pk, max_step__lt=e[2]).update(max_step=e[2], last_progress_at=at(e[3]))
        Job.objects.filter(pk=job.pk).update(last_step=e[2])
    elif kind == "sample":
        TrainingSample.objects.create(job=job, at=at(e[3]), rank=0, step=e[2])
    elif kind == "cycle_open":
        RestartCycle.objects.create(job=job, key=e[2], layer="in_process", fault_at=at(e[3]), step_at_fault=e[4])
    elif kind == "cycle_close":
        RestartCycle.objects.filter(job=job, key=e[2]).update(first_step_at=at(e[3]), resumed_from_step=e[4])
    elif kind == "ckpt_start":
        Checkpoint.objects.create(job=job, step=e[3], attempt_key=e[2], started_at=at(e[4]), mode=e[5])
    elif kind == "ckpt_done":
        Checkpoint.objects.filter(job=job, attempt_key=e[2]).update(state="durable", finished_at=at(e[3]),
                                                                    blocking_s=e[4], interference_s=e[5])
    elif kind == "ckpt_abandon":
        Checkpoint.objects.filter(job=job, attempt_key=e[2]).update(state="abandoned", finished_at=at(e[3]))


@pytest.mark.parametrize("seed", range(12))
def test_goodput_adds_up_and_productive_time_never_decreases(seed):
    """Replays a generated job fact by fact, as the control plane learns them, and reads goodput in
    between: the parts add up to wall time at every moment, productive time and wall time never go down
    (through the launch and operators' restarts too), and the finished job's goodput is the running
    job's at its last moment (idle is computed one way)."""
    from controlplane.jobs.models import Job

    rng = random.Random(seed)
    events, end = _simulate(rng)
    base = timezone.now() - timedelta(seconds=end + 60)
    job = make_job(now=base, age_s=0, started_at=None, created_at=base, first_step_at=None, last_step=0,
                   last_progress_at=None)
    times = sorted({e[0] for e in events} | {rng.uniform(0, end) for _ in range(20)} | {end})
    i, before, wall = 0, -1.0, -1.0
    for t in times:
        while i < len(events) and events[i][0] <= t:
            _apply(job, base, events[i])
            i += 1
        job.refresh_from_db()
        g = compute_goodput(job, base + timedelta(seconds=t))
        assert_adds_up(g)
        assert g["productive_s"] >= before - 2e-3, (seed, t, before, g)
        assert g["wall_s"] >= wall - 2e-3, (seed, t, wall, g)
        before, wall = g["productive_s"], g["wall_s"]
    running = compute_goodput(job, base + timedelta(seconds=end))
    Job.objects.filter(pk=job.pk).update(status="succeeded", finished_at=base + timedelta(seconds=end))
    job.refresh_from_db()
    finished = compute_goodput(job, base + timedelta(seconds=end + 50))
    assert finished == pytest.approx(running, abs=1e-6)
