"""Checkpoints: only durable ones (.metadata + COMMITTED) are loaded; torn ones are reported and removed;
the last K are kept."""

import shutil
import subprocess

import pytest

from tests.trainer.conftest import PYTHON, ROOT, Receiver, child_env
from trainer.checkpoint import COMMITTED, latest_durable, list_checkpoints, step_dir


def make_ckpt(root, step, *, metadata=True, committed=True):
    d = step_dir(str(root), step)
    import os
    os.makedirs(d)
    open(f"{d}/__0_0.distcp", "w").close()
    if metadata:
        open(f"{d}/.metadata", "w").close()
    if committed:
        open(f"{d}/{COMMITTED}", "w").close()


def test_it_only_counts_committed_checkpoints_with_metadata(tmp_path):
    assert latest_durable(str(tmp_path / "missing")) is None
    make_ckpt(tmp_path, 10)
    make_ckpt(tmp_path, 20, committed=False)  # torn: every shard + .metadata, but no marker
    make_ckpt(tmp_path, 30, metadata=False)  # torn: rank 0 never wrote .metadata
    assert latest_durable(str(tmp_path)) == 10
    assert [(s, d) for s, _, d in list_checkpoints(str(tmp_path))] == [(10, True), (20, False), (30, False)]


def train(run_dir, steps, url=None):
    """The built-in example alone (a 1-rank world), under the shim as the launcher runs it."""
    cmd = [PYTHON, "-m", "trainer.shim", "--run-dir", str(run_dir), "--ckpt-interval", "5", "--keep-ckpts", "2",
           "--no-in-process"]
    if url:
        cmd += ["--report-url", url, "--job-id", "1", "--report-interval", "0.1"]
    cmd += ["--", "trainer.examples.synthetic:train", "--steps", str(steps), "--log-every", "0"]
    p = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout + p.stderr


@pytest.mark.slow
def test_it_skips_a_torn_checkpoint_and_resumes_from_the_newest_durable(tmp_path):
    root = tmp_path / "checkpoints"
    train(tmp_path, 20)
    assert [(s, d) for s, _, d in list_checkpoints(str(root))] == [(15, True), (20, True)]  # --keep-ckpts 2
    torn = step_dir(str(root), 25)
    shutil.copytree(step_dir(str(root), 20), torn)
    (root / f"step_{25:09d}" / COMMITTED).unlink()
    recv = Receiver().start()
    try:
        out = train(tmp_path, 30, url=recv.url)
        ckpt_events = [e["data"] for e in recv.events("checkpoint")]
    finally:
        recv.stop()
    assert "resuming at step 20" in out
    assert {"step": 25, "state": "abandoned", "detail": "torn by a restart"} in ckpt_events
    durable = [e["step"] for e in ckpt_events if e["state"] == "durable"]
    assert durable == [25, 30]
    assert [(s, d) for s, _, d in list_checkpoints(str(root))] == [(25, True), (30, True)]
    for e in ckpt_events:
        if e["state"] == "durable":
            assert e["bytes"] > 0 and e["write_s"] >= 0 and e["blocking_s"] >= 0 and e["mode"] in ("sync", "async")
