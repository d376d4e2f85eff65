"""Standby ranks (trainer/standby.py): real processes, a real pool, a real worker client, a Level-0 script.

The worker is what ft_launcher starts and watches; the rank runs in a standby. What the launcher sees of
the worker must be what it would see of the rank itself: its output, its exit status, its death by a
signal; signals sent to the worker reach the rank, and a worker killed outright takes its rank along.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.trainer.conftest import ROOT, child_env
from trainer.standby import ENV_SOCKET, StandbyPool, can_renice

SCRIPT = """
import os, signal, sys, time
mode = sys.argv[1]
out = sys.argv[2]
open(out + ".pid", "w").write(str(os.getpid()))
nice = max(os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task"))
print(f"rank says hello from {os.getpid()} in {os.getcwd()} with {os.environ.get('MARK')} at nice {nice}", flush=True)
if mode == "exit":
    sys.exit(3)
if mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "term":
    def on_term(signum, frame):
        open(out + ".term", "w").write("got it")
        sys.exit(7)
    signal.signal(signal.SIGTERM, on_term)
    print("waiting", flush=True)
    time.sleep(120)
"""


@pytest.fixture(scope="module")
def pool():
    p = StandbyPool(2, cwd=str(ROOT)).start()
    yield p
    p.stop()


def worker(tmp_path: Path, pool: StandbyPool | None, mode: str) -> subprocess.Popen:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    if pool is not None and not pool._stopped:
        wait_ready(pool, 1)  # the tests take standbys faster than the pool refills
    env = child_env(MARK="m-42", **({ENV_SOCKET: pool.address} if pool else {}))
    cmd = [sys.executable, "-m", "trainer.standby", "--run-dir", str(tmp_path / "run"), "--no-in-process", "--",
           str(script), mode, str(tmp_path / "out")]
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_ready(pool: StandbyPool, n: int, timeout_s: float = 90) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not pool.ready(n):
        time.sleep(0.1)
    return pool.ready(n)


def rank_pid(tmp_path: Path, timeout_s: float = 60) -> int:
    f = tmp_path / "out.pid"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if f.exists() and f.read_text():
            return int(f.read_text())
        time.sleep(0.05)
    raise AssertionError("the rank never started")


def nice_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


def gone(pid: int, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
            return True  # ended, not yet reaped by the pool's thread
        time.sleep(0.05)
    return False


def test_the_rank_runs_in_a_standby_with_the_workers_env_cwd_output_and_exit_status(tmp_path, pool):
    taken = pool.taken
    p = worker(tmp_path, pool, "exit")
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 3, out
    pid = rank_pid(tmp_path)
    assert pid != p.pid  # another process ran it: a standby of the pool
    assert pool.taken == taken + 1
    assert f"rank says hello from {pid} in {tmp_path} with m-42 at nice 0" in out  # back from the standby's 19
    assert (tmp_path / "run" / "logs" / "rank0.log").exists()  # the shim ran around it


def test_a_rank_killed_by_a_signal_is_a_worker_killed_by_it(tmp_path, pool):
    p = worker(tmp_path, pool, "kill")
    p.communicate(timeout=120)
    assert p.returncode == -signal.SIGKILL


def test_signals_to_the_worker_reach_the_rank(tmp_path, pool):
    p = worker(tmp_path, pool, "term")
    assert p.stdout.readline()  # hello
    assert p.stdout.readline().strip() == "waiting"
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=60)
    assert p.returncode == 7
    assert (tmp_path / "out.term").read_text() == "got it"


def test_a_worker_killed_outright_takes_its_rank_along(tmp_path, pool):
    p = worker(tmp_path, pool, "term")
    assert p.stdout.readline()
    pid = rank_pid(tmp_path)
    assert pid != p.pid
    p.kill()
    p.wait()
    assert gone(pid)


def test_the_pool_refills_what_was_taken(pool, tmp_path):
    p = worker(tmp_path, pool, "exit")
    p.communicate(timeout=120)
    assert wait_ready(pool, 2)
    if can_renice():  # waiting standbys imported at nice 19, off the running ranks' CPU
        for standby in pool._idle:
            assert nice_of(standby.proc.pid) == 19


def test_without_a_pool_the_worker_runs_the_rank_itself(tmp_path):
    p = worker(tmp_path, None, "exit")
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 3, out
    assert rank_pid(tmp_path) == p.pid  # exec'd in place: the same process
    stopped = StandbyPool(1, cwd=str(ROOT)).start()
    stopped.stop()  # a pool that is gone: the same
    (tmp_path / "out.pid").unlink()
    p = worker(tmp_path, stopped, "exit")
    p.communicate(timeout=120)
    assert p.returncode == 3 and rank_pid(tmp_path) == p.pid


def test_the_jobs_first_ranks_start_themselves_while_the_standbys_import(tmp_path):
    first = StandbyPool(1, cwd=str(ROOT), skip_first=1).start()
    try:
        p = worker(tmp_path, first, "exit")
        p.communicate(timeout=120)
        assert p.returncode == 3 and rank_pid(tmp_path) == p.pid  # the first rank: its own process
        assert first.taken == 0
        assert wait_ready(first, 1)
        standby = first._idle[0].proc.pid
        assert nice_of(standby) == 0  # normal priority
        (tmp_path / "out.pid").unlink()
        p = worker(tmp_path, first, "exit")
        p.communicate(timeout=120)
        assert p.returncode == 3 and rank_pid(tmp_path) == standby  # a restart's rank: the standby
    finally:
        first.stop()
