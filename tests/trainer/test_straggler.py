"""Stragglers from real launches (2 ranks, gloo on CPU): the ranks' busy_s, judged by the control plane's
rule as the batches arrive, finds the slow_rank drill's rank and nobody in a clean run."""

import pytest

from controlplane.jobs.spec import Drill, JobSpec
from controlplane.launchers.command import trainer_args
from tests.trainer.conftest import launch
from tests.trainer.stragglers import straggler_marks
from trainer.straggler import BusyClock

pytestmark = pytest.mark.django_db  # pytest-django: the rule's module imports the models


def run(tmp_path, receiver, drills=()):
    # A 2 s window: each rank's first window is warm-up (no busy_s), and 90 steps last 6-10 s here.
    spec = JobSpec(steps=90, checkpoint_interval=20, drills=drills, straggler_window_s=2)
    r = launch(tmp_path, trainer_flags=trainer_args(spec), report_url=receiver.url,
               report_interval=spec.heartbeat_interval_s)
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


def test_an_attempts_first_window_is_warm_up(monkeypatch):
    """No busy_s until the window is full (again after a restart): warm-up steps are slower on every rank,
    and ranks judged at different points of that falling curve would differ by more than the margin."""
    clock = {"t": 100.0}
    monkeypatch.setattr("trainer.straggler.time.monotonic", lambda: clock["t"])
    busy = BusyClock(window_s=2.0)

    def steps(n):
        out = []
        for _ in range(n):
            clock["t"] += 0.25
            out.append(busy.step())
        return out

    first = steps(12)  # 3 s of steps
    assert first[:8] == [None] * 8 and all(v is not None and v >= 0 for v in first[8:]), first
    busy.reset()
    assert steps(8) == [None] * 8 and steps(1)[0] is not None
