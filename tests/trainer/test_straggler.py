"""Stragglers from real launches (2 ranks, gloo on CPU): the ranks' busy_s, judged by the control plane's
rule as the batches arrive, finds the slow_rank drill's rank and nobody in a clean run."""

import time

import pytest

from controlplane.jobs.spec import Drill, JobSpec
from tests.trainer.conftest import launch_spec
from tests.trainer.stragglers import straggler_marks
from trainer.straggler import BusyClock

pytestmark = pytest.mark.django_db  # pytest-django: the rule's module imports the models


def run(tmp_path, receiver, drills=()):
    # The product's defaults (a 5 s window, a 20 % margin): each rank's first window is warm-up (no busy_s),
    # and 200 steps last ~15-20 s here. A 2 s window judged two ranks sharing 2 cores with their savers and
    # reporters too closely: a clean run's rank crossed 20 % in one window now and then (a false straggler).
    spec = JobSpec(steps=200, checkpoint_interval=20, drills=drills)
    r = launch_spec(tmp_path, spec, report_url=receiver.url)
    assert r.rc == 0, r.log[-4000:]
    return receiver.batches, spec.straggler_margin_pct


def test_it_finds_no_straggler_in_a_clean_run(tmp_path, receiver):
    batches, margin = run(tmp_path, receiver)
    beats = [h for b in batches for h in b["heartbeats"]]
    assert {h["rank"] for h in beats if h.get("busy_s")} == {0, 1}  # both ranks measured their work
    assert straggler_marks(batches, margin) == []


def test_it_marks_the_slowed_rank_after_its_drill(tmp_path, receiver):
    batches, margin = run(tmp_path, receiver, drills=(Drill(step=30, fault="slow_rank", rank=1, fraction=0.5),))
    beats = [h for b in batches for h in b["heartbeats"]]
    start = min(h["at"] for h in beats if h["rank"] == 1 and h["step"] >= 30)
    marks = straggler_marks(batches, margin)
    assert marks and marks[0][1] == 1 and marks[0][0] >= start, marks
    assert all(r == 1 for _, r in marks), marks
    # A slow rank is not a fault: nothing restarted.
    assert not [e for b in batches for e in b["events"] if e["kind"] == "fault"]


def test_an_attempts_first_window_is_warm_up():
    """No busy_s until a window has passed (again after a restart): warm-up steps are slower on every
    rank, and ranks judged at different points of that falling curve would differ by more than the margin."""
    busy = BusyClock(window_s=2.0, sample_s=0.25, thread=False)
    t = cpu = 100.0
    seen = []
    for _ in range(16):  # 4 s: a step every 0.25 s costing 0.1 s of CPU, then a sample
        seen.append(busy.step())
        t, cpu = t + 0.25, cpu + 0.1
        busy.sample(now=t, cpu=cpu)
    assert seen[:9] == [None] * 9 and seen[9:] == [pytest.approx(0.1)] * 7, seen
    busy.reset()
    assert busy.step() is None
    busy.sample(now=t + 0.25, cpu=cpu + 0.1)
    assert busy.step() is None  # the new attempt's window has just begun


def test_the_sampler_reads_the_training_threads_cpu_time():
    """The real clock: the sampler thread reads the stepping thread's CPU time, not its own."""
    busy = BusyClock(window_s=1.0, sample_s=0.05)
    values = []
    try:
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            spin_until = time.thread_time() + 0.01  # 10 ms of this thread's CPU per step
            while time.thread_time() < spin_until:
                pass
            values.append(busy.step())
    finally:
        busy.close()
    measured = [v for v in values if v is not None]
    assert values[0] is None and measured, values[:5]
    assert 0.008 <= measured[-1] <= 0.015, measured[-5:]
