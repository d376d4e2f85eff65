"""Ranks end with their launcher: a ``trainer.launch`` killed with SIGKILL (it can stop nothing) leaves no
rank training (2 ranks, gloo on CPU, real processes)."""

import os
import signal
import subprocess
import time

import psutil
import pytest

from controlplane.jobs.spec import JobSpec
from tests.helpers import wait_for
from tests.trainer.conftest import ROOT, spec_command

pytestmark = [pytest.mark.slow, pytest.mark.nvrx]


def test_it_ends_the_ranks_when_the_launcher_is_killed(tmp_path, receiver):
    spec = JobSpec(steps=100000, checkpoint_interval=1000)
    cmd, env = spec_command(tmp_path, spec, report_url=receiver.url)
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    ranks: list[psutil.Process] = []
    try:
        wait_for(
            lambda: {e["rank"] for e in receiver.events("rank_started")} == {0, 1},
            timeout_s=180,
            what="both ranks to start",
        )
        wait_for(lambda: any(h["step"] >= 5 for h in receiver.heartbeats()), timeout_s=120, what="training")
        ranks = [psutil.Process(e["data"]["pid"]) for e in receiver.events("rank_started")]
        assert all(r.is_running() for r in ranks)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        t0 = time.monotonic()
        _, alive = psutil.wait_procs(ranks, timeout=15)
        assert not alive, [(p.pid, p.cmdline()[:4]) for p in alive]
        assert time.monotonic() - t0 < 15
    finally:
        for p in ranks:  # what the test did not end (its rank workers run in their own sessions)
            try:
                p.kill()
            except psutil.Error:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
