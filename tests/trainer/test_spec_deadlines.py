"""A preset job runs with the spec's deadlines: ft_launcher ends a hung rank of the built-in model at the
spec's step timeout (the one the control plane judges by), not at the trainer's own default of 30 s
(2 ranks, gloo on CPU, real processes, launched with the control plane's own argv)."""

import subprocess
import time

import pytest

from controlplane.jobs.spec import Drill, JobSpec
from controlplane.launchers.command import launch_args
from tests.trainer.conftest import PYTHON, ROOT, child_env
from trainer.ports import free_port_block

pytestmark = [pytest.mark.slow, pytest.mark.nvrx]


def test_it_ends_a_hung_preset_rank_at_the_specs_step_timeout(tmp_path, receiver):
    spec = JobSpec(preset="tiny", steps=30, checkpoint_interval=5, in_process=False, max_in_job_restarts=1,
                   heartbeat_interval_s=0.5, step_timeout_s=6.0, drills=(Drill(step=10, fault="hang", rank=1),))
    argv = launch_args(spec, node_rank=0, rdzv_endpoint=f"127.0.0.1:{free_port_block()}", run_dir=str(tmp_path),
                       job_id="job-1", attempt=0, report_url=receiver.url)
    assert "--preset" in argv and argv[argv.index("--step-timeout") + 1] == "6"
    t0 = time.monotonic()
    proc = subprocess.run([PYTHON, "-m", "trainer.launch", *argv], cwd=ROOT, env=child_env(UNBROKEN_TOKEN="t"),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:]
    faults = [e["data"] for e in receiver.events("fault")]
    assert [(f["fault"], f["detected_by"], f["rank"]) for f in faults] == [("hang", "launcher", 1)], faults
    marks = {e["data"]["mark"]: e["at"] for e in receiver.events("cycle") if e["data"]["cycle"] == "a0-ij1"}
    waited = marks["detected_at"] - marks["fault_at"]
    # ft_launcher's heartbeat timeout is the spec's 6 s (its own default would be 30 s); it checks every 0.5 s.
    assert 5.0 <= waited < 12.0, (waited, time.monotonic() - t0)
