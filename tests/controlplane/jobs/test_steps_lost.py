"""Steps lost, manual restarts and re-saved checkpoints come from the trainer's own facts."""

import time

import pytest
from django.utils import timezone

from controlplane.jobs.models import Checkpoint, Command, RestartCycle
from tests.controlplane.conftest import ev, make_job
from tests.controlplane.jobs.test_ingestion import cycle_ev, record

pytestmark = pytest.mark.django_db


def test_it_counts_steps_lost_from_the_fault_step_and_the_restored_step_not_its_own_lagging_copy():
    t = time.time() - 30
    start = timezone.now() - timezone.timedelta(seconds=60)
    # The control plane's copy of the step lags the trainer (flush, batching).
    job, _ = make_job(last_step=45, created_at=start, started_at=start, first_step_at=start)
    record(job, events=[cycle_ev("d", "a0-ij1", "detected_at", t + 1, layer="in_job")])  # the first fact seen
    fault = {"fault": "process_killed", "cycle": "a0-ij1", "step": 60}
    record(job, events=[ev("f", "fault", fault, at=t + 1),
                        cycle_ev("m", "a0-ij1", "fault_at", t, layer="in_job", step=60),
                        cycle_ev("l", "a0-ij1", "checkpoint_loaded_at", t + 3, layer="in_job", step=40),
                        cycle_ev("s", "a0-ij1", "first_step_at", t + 4, layer="in_job", step=41)])
    c = RestartCycle.objects.get(job=job)
    assert (c.step_at_fault, c.resumed_from_step, c.lost_steps) == (60, 40, 20)
    g = job.goodput(timezone.now())
    # Goodput books the time spent recomputing those 20 steps (until the fault's step is passed again) as
    # lost work, and its parts still add up to wall time.
    assert g["lost_work_s"] > 0
    assert sum(g[f"{k}_s"] for k in ("productive", "checkpoint_blocking", "checkpoint_interference", "recovery",
                                     "lost_work", "startup", "idle")) == pytest.approx(g["wall_s"])


def test_it_falls_back_to_its_freshest_step_for_a_trainer_that_sends_none():
    job, _ = make_job(last_step=150)
    t = time.time() - 30
    record(job, events=[ev("f", "fault", {"fault": "exception", "cycle": "a0-ij0-ip1"}, at=t),
                        cycle_ev("l", "a0-ij0-ip1", "checkpoint_loaded_at", t + 1, step=140)])
    c = RestartCycle.objects.get(job=job)
    assert (c.step_at_fault, c.step_at_fault_estimate, c.lost_steps) == (None, 150, 10)
    # The trainer's fact, arriving later, wins over the estimate.
    record(job, events=[cycle_ev("m", "a0-ij0-ip1", "fault_at", t, step=147)])
    assert RestartCycle.objects.get(job=job).lost_steps == 7


def test_it_takes_the_restored_step_from_the_first_step_at_level_1():
    job, _ = make_job()
    t = time.time() - 30
    record(job, events=[cycle_ev("m", "a0-ij1", "fault_at", t, layer="in_job", step=250),
                        cycle_ev("s", "a0-ij1", "first_step_at", t + 4, layer="in_job", step=241)])
    assert RestartCycle.objects.get(job=job).lost_steps == 10


def test_it_starts_a_manual_restart_at_the_commands_issue_time_with_delivery_as_its_own_part():
    job, _ = make_job()
    issued = timezone.now() - timezone.timedelta(seconds=20)
    cmd = Command.objects.create(job=job, kind="restart", level="in_process", issued_at=issued,
                                 delivered_at=issued + timezone.timedelta(seconds=0.8), status="acked")
    t = issued.timestamp() + 1.0
    record(job, events=[cycle_ev("d", "a0-ij0-ip1", "detected_at", t + 0.1),
                        cycle_ev("m", "a0-ij0-ip1", "fault_at", t, step=90, command_id=cmd.pk),
                        cycle_ev("s", "a0-ij0-ip1", "first_step_at", t + 1.0, step=81)])
    c = RestartCycle.objects.get(job=job)
    assert c.command_id == cmd.pk and c.fault_at == issued and c.delivered_at == cmd.delivered_at
    d = c.durations()
    assert list(d)[0] == "deliver" and d["deliver"] == pytest.approx(0.8)
    assert d["detect"] == pytest.approx(0.3, abs=1e-3)
    assert c.recovery_s == pytest.approx(2.0, abs=1e-3)
    assert c.reason.startswith(f"restart command {cmd.pk}")


def test_it_shows_a_step_saved_again_after_an_abandoned_attempt_as_durable_and_keeps_both():
    job, _ = make_job()
    t = time.time() - 30
    record(job, events=[ev("k1", "checkpoint", {"step": 60, "state": "in_flight", "mode": "async"}, at=t)])
    record(job, events=[ev("k2", "checkpoint", {"step": 60, "state": "abandoned"}, at=t + 1)])
    record(job, events=[ev("k3", "checkpoint", {"step": 60, "state": "in_flight"}, at=t + 5)])
    record(job, events=[ev("k4", "checkpoint", {"step": 60, "state": "durable", "write_s": 0.5}, at=t + 6)])
    record(job, events=[ev("k2", "checkpoint", {"step": 60, "state": "abandoned"}, at=t + 1)])  # a retry
    rows = list(Checkpoint.objects.filter(job=job, step=60).order_by("started_at")
                .values_list("state", flat=True))
    assert rows == ["abandoned", "durable"]


def test_it_does_not_open_an_attempt_for_a_late_final_state():
    job, _ = make_job()
    t = time.time() - 30
    record(job, events=[ev("k1", "checkpoint", {"step": 60, "state": "in_flight"}, at=t),
                        ev("k2", "checkpoint", {"step": 60, "state": "durable"}, at=t + 1)])
    record(job, events=[ev("k3", "checkpoint", {"step": 60, "state": "failed"}, at=t + 6)])
    assert list(Checkpoint.objects.filter(job=job, step=60).values_list("state", flat=True)) == ["durable"]
