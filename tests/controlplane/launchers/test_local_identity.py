"""The local launcher tells its launcher process from a later process with the same pid by the kernel's
start time in clock ticks since boot, not by wall-clock seconds: a clock step (a paused or overloaded VM)
must not make a live launcher look gone (that restarts the whole job), and a reused pid must."""

import subprocess
import sys

import psutil
import pytest

from controlplane.launchers.local import _launcher_process, start_ticks

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")


@pytest.fixture()
def sleeper():
    p = subprocess.Popen(["sleep", "60"])
    yield p
    p.kill()
    p.wait()


def state_of(pid: int, *, clock_step_s: float = 0.0) -> dict:
    return {"pid": pid, "start_ticks": start_ticks(pid),
            "create_time": psutil.Process(pid).create_time() + clock_step_s}


def test_a_live_launcher_is_found_after_the_wall_clock_moved(sleeper):
    proc, why = _launcher_process(state_of(sleeper.pid, clock_step_s=5.0))
    assert proc is not None and proc.pid == sleeper.pid, why


def test_another_process_on_the_same_pid_is_not_the_launcher(sleeper):
    st = {**state_of(sleeper.pid), "start_ticks": start_ticks(sleeper.pid) - 1}
    proc, why = _launcher_process(st)
    assert proc is None and "another process" in why


def test_an_ended_launcher_is_gone_and_says_why(sleeper):
    st = state_of(sleeper.pid)
    sleeper.kill()
    sleeper.wait()
    proc, why = _launcher_process(st)
    assert proc is None and f"no process {sleeper.pid}" in why


def test_the_ticks_agree_with_psutils_start_time(sleeper):
    hz = 100  # USER_HZ on Linux
    seconds = psutil.Process(sleeper.pid).create_time() - psutil.boot_time()
    assert abs(start_ticks(sleeper.pid) / hz - seconds) < 0.05
