"""A preset job runs with the spec's deadlines: ft_launcher ends a hung rank of the built-in model at the
spec's step timeout (the one the control plane judges by), not at the trainer's own default of 30 s
(2 ranks, gloo on CPU, real processes, launched with the control plane's own argv)."""

import pytest

from controlplane.jobs.spec import Drill, JobSpec
from tests.trainer.conftest import launch_spec

pytestmark = [pytest.mark.slow, pytest.mark.nvrx]


def test_it_ends_a_hung_preset_rank_at_the_specs_step_timeout(tmp_path, receiver):
    spec = JobSpec(
        preset="tiny",
        steps=30,
        checkpoint_interval=5,
        in_process=False,
        max_in_job_restarts=1,
        heartbeat_interval_s=0.5,
        step_timeout_s=6.0,
        drills=(Drill(step=10, fault="hang", rank=1),),
    )
    run = launch_spec(tmp_path, spec, report_url=receiver.url)
    assert run.rc == 0, run.log[-4000:]
    started = receiver.events("rank_started")
    assert started and all(e["data"]["settings"]["step_timeout_s"] == 6.0 for e in started), started
    faults = [e["data"] for e in receiver.events("fault")]
    # ft_launcher reports every rank it ended. Rank 1's is a hang, found by the launcher. Rank 0 waited in a
    # collective: it reads as a hang too, or as gloo's exception when rank 1's end reset its connection first
    # (a race); either way the control plane links it to rank 1's hang as an echo (controlplane/jobs/attribution).
    reported = [(f["fault"], f["detected_by"], f["rank"]) for f in faults]
    assert {r for r in reported if r[2] == 1} == {("hang", "launcher", 1)}, faults
    assert {r[0] for r in reported if r[2] == 0} <= {"hang", "exception"}, faults
    marks = {e["data"]["mark"]: e["at"] for e in receiver.events("cycle") if e["data"]["cycle"] == "a0-ij1"}
    waited = marks["detected_at"] - marks["fault_at"]
    # ft_launcher's heartbeat timeout is the spec's 6 s (its own default would be 30 s); it checks every 0.5 s.
    assert 5.0 <= waited < 12.0, waited
