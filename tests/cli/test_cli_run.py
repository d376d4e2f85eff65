"""``unbroken run`` end to end: the shipped Level-0 example under a live control plane (a real Celery worker
and beat, two real ranks on gloo) with a SIGKILL drill, watched from a pseudo-terminal as a user would, while
``unbroken logs -f`` follows the same job from a second shell."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from controlplane.jobs.models import Job
from controlplane.launchers.services import supervise_all
from tests.cli.conftest import EXAMPLES, UNBROKEN, in_pty, read_pty, unbroken, validate
from tests.helpers import end_job

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")


def test_it_runs_the_level0_example_through_a_sigkill_and_shows_it(operator_env, e2e_settings,
                                                                     celery_beat_thread, tmp_path):
    env = {**operator_env, "TERM": "xterm-256color"}
    args = ["run", "--nproc-per-node", "2", "--steps", "200", "--drill", "60:sigkill:1",
            "--set", "step_timeout_s=5", "--set", "heartbeat_interval_s=0.5", "--set", "stall_timeout_s=60",
            "--wait", str(EXAMPLES / "plain_fsdp.py"), "--", "--steps", "200"]
    proc, master = in_pty(args, env, tmp_path)
    screen = bytearray()
    follower = None
    job = None
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            supervise_all()  # beat does this too; here it keeps pace with the test's polls
            read_pty(master, screen)
            if follower is None and (m := re.search(rb"Job (\d+): http", screen)):
                job = Job.objects.get(pk=int(m.group(1)))
                follower = subprocess.Popen([str(UNBROKEN), "logs", "-f", str(job.pk)], env=operator_env,
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            time.sleep(0.5)
        read_pty(master, screen)
        text = ANSI.sub("", screen.decode(errors="replace"))
        ARTIFACTS.mkdir(exist_ok=True)
        (ARTIFACTS / "cli-run-pty.txt").write_bytes(bytes(screen))  # the raw terminal session (cat it)
        assert proc.poll() == 0, text[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
        if job is not None:
            end_job(job)

    # The URL first, then what happened as it happened: the fault, the in-job cycle with its phases, the end.
    url = f"{operator_env['UNBROKEN_URL']}/jobs/{job.pk}/"
    assert text.lstrip().startswith(f"Job {job.pk}: {url}"), text[:300]
    assert re.search(r"✗ fault \d+: process_killed on rank 1", text), text[-4000:]
    cycle = re.search(r"↻ restart \(in-job\) recovered in [\d.]+ s \(detect [\d.]+ s, abort [\d.]+ s, "
                      r"restart [\d.]+ s, first step [\d.]+ s\); resumed from step \d+", text)
    assert cycle, text[-4000:]
    assert text.index("process_killed") < cycle.start()
    assert re.search(rf"job {job.pk} succeeded at step \d+", text)  # as far as the last flushed heartbeat
    assert "│ step 199 loss" in text  # the log tail, streamed
    # The bar advanced: it was drawn at several steps on the way (the restart may take it back a step or two).
    bars = [int(s) for s in re.findall(r"step (\d+)/200", text)]
    assert len(set(bars)) >= 3 and bars[0] < 60 < bars[-1], bars
    assert re.search(r"loss \d", text) and re.search(r"[\d.]+ steps/s", text)

    # `logs -f` followed the same job until it ended, and exited with its outcome.
    out, err = follower.communicate(timeout=60)
    assert follower.returncode == 0, err
    assert "FINAL_LOSS" in out and "step 200 loss" in out

    # --json of a job with a fault and a cycle validates against the operator API's types.
    detail = unbroken(operator_env, "status", str(job.pk), "--json")
    validate(json.loads(detail.stdout), "JobDetail")
    human = unbroken(operator_env, "status", str(job.pk)).stdout
    assert "succeeded" in human and "in_job 1" in human and "✗ fault" in human
