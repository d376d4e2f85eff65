"""Checkpoints: only durable ones (.metadata + COMMITTED) are loaded; torn ones are reported and removed;
the last K are kept."""

import logging
import shutil
import subprocess

import pytest

from tests.trainer.conftest import PYTHON, ROOT, Receiver, child_env
from trainer.checkpoint_layout import COMMITTED, latest_durable, list_checkpoints, step_dir


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


@pytest.fixture
def one_rank_world():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.new_group(backend="gloo")
    dist.destroy_process_group()


def _app(seed):
    import torch
    from torch.distributed.fsdp import fully_shard

    from trainer.fullrun import _AppState

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return _AppState(model=model, optim=opt, extra={}, rank=0), model, opt


def _weights(model):
    return [p.full_tensor().clone() for p in model.parameters()]


def test_it_restores_from_the_memory_snapshot_only_when_it_is_complete_and_newest(tmp_path, one_rank_world):
    from trainer.checkpoint import Checkpointer, MemorySnapshot
    from trainer.wire import CheckpointMode

    memory = MemorySnapshot()
    state, model, opt = _app(0)
    ck = Checkpointer(root=str(tmp_path), mode=CheckpointMode.ASYNC, keep=2, pg=one_rank_world,
                      report=lambda *a, **k: None, memory=memory)
    ck.save(state, 5)
    ck.wait()
    saved = _weights(model)
    assert memory.get()[0] == 5

    # A new attempt: a fresh model and optimizer (another seed: other weights) take the snapshot's state.
    state2, model2, opt2 = _app(1)
    assert any(not a.equal(b) for a, b in zip(saved, _weights(model2), strict=True))
    ck2 = Checkpointer(root=str(tmp_path), mode=CheckpointMode.ASYNC, keep=2, pg=one_rank_world,
                       report=lambda *a, **k: None, memory=memory)
    assert ck2.load(state2) == 5 and ck2.restored_from == "memory"
    assert all(a.equal(b) for a, b in zip(saved, _weights(model2), strict=True))
    snap_model = memory.get()[1]["app"]["model"]
    assert all(v.to_local().data_ptr() != p.to_local().data_ptr()  # a copy, not the live tensors
               for v, p in zip(snap_model.values(), model2.parameters(), strict=True))

    ck2.save(state2, 7, mode=CheckpointMode.SYNC)  # durable 7 is newer than the snapshot (5): the disk wins
    assert ck2.load(_app(2)[0]) == 7 and ck2.restored_from == "disk"
    memory.staged(9, memory.get()[1])
    memory.staging()  # a save started staging over the snapshot's buffers: no snapshot
    assert ck2.load(_app(3)[0]) == 7 and ck2.restored_from == "disk"
    ck.close()
    ck2.close()


def _optim_state(opt):
    return [v.to_local().clone() if hasattr(v, "to_local") else v.clone()
            for st in opt.state.values() for v in st.values() if hasattr(v, "clone")]


def test_new_processes_restore_from_the_node_local_copy_only_when_it_is_complete_and_newest(tmp_path, one_rank_world):
    import os

    from trainer.checkpoint import Checkpointer, LocalCopy, MemorySnapshot
    from trainer.wire import CheckpointMode

    local = str(tmp_path / "local")
    state, model, opt = _app(0)
    ck = Checkpointer(root=str(tmp_path / "ckpt"), mode=CheckpointMode.ASYNC, keep=2, pg=one_rank_world,
                      report=lambda *a, **k: None, memory=MemorySnapshot(), local_dir=local)
    ck.save(state, 5)
    ck.wait()  # durable, then copied by the writer thread before the save ends
    saved, saved_opt = _weights(model), _optim_state(opt)
    assert os.listdir(f"{local}/rank0") == [f"step_{5:09d}.w1.pt"]

    def new_process(seed):  # an in-job restart: a new process has no memory snapshot
        st, m, o = _app(seed)
        c = Checkpointer(root=str(tmp_path / "ckpt"), mode=CheckpointMode.ASYNC, keep=2, pg=one_rank_world,
                         report=lambda *a, **k: None, memory=MemorySnapshot(), local_dir=local)
        return c, st, m, o

    ck2, state2, model2, opt2 = new_process(1)
    assert any(not a.equal(b) for a, b in zip(saved, _weights(model2), strict=True))
    assert ck2.load(state2) == 5 and ck2.restored_from == "local"
    assert all(a.equal(b) for a, b in zip(saved, _weights(model2), strict=True))
    assert all(a.equal(b) for a, b in zip(saved_opt, _optim_state(opt2), strict=True))

    ck2.save(state2, 7, mode=CheckpointMode.SYNC)  # a durable checkpoint newer than the copy: the disk wins
    ck3, state3, _, _ = new_process(2)
    assert ck3.load(state3) == 7 and ck3.restored_from == "disk"

    ck3.save(state3, 9)  # async: copied; then the copy is torn (not loadable): the disk, not a crash
    ck3.wait()
    assert LocalCopy(local, rank=0, world=1).newest() == 9
    with open(f"{local}/rank0/step_{9:09d}.w1.pt", "wb") as f:
        f.write(b"torn")
    ck4, state4, _, _ = new_process(3)
    assert ck4.load(state4) == 9 and ck4.restored_from == "disk"
    # A copy made for another world size (the job was resized) is not this rank's state.
    os.rename(f"{local}/rank0/step_{9:09d}.w1.pt", f"{local}/rank0/step_{11:09d}.w2.pt")
    assert LocalCopy(local, rank=0, world=1).newest() is None
    for c in (ck, ck2, ck3, ck4):
        c.close()


def test_a_node_local_copy_that_would_not_fit_is_skipped_and_no_older_one_is_left(tmp_path, one_rank_world,
                                                                                 monkeypatch, caplog):
    import shutil
    from collections import namedtuple

    from trainer.checkpoint import LocalCopy

    caplog.set_level(logging.WARNING, logger="trainer.checkpoint")
    copy_ = LocalCopy(str(tmp_path), rank=0, world=1)
    state, _, _ = _app(0)
    assert copy_.write(3, {"app": state.state_dict()}) and copy_.newest() == 3
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(1 << 20, 1 << 20, 0))
    assert not copy_.write(4, {"app": state.state_dict()})
    assert copy_.newest() is None  # step 3 is older than the durable step 4: never to be restored
    assert "node-local checkpoint copy skipped" in caplog.text


def test_a_node_local_directory_that_cannot_be_made_turns_the_copies_off_not_the_job(tmp_path, one_rank_world, caplog):
    from trainer.checkpoint import Checkpointer, MemorySnapshot
    from trainer.wire import CheckpointMode

    caplog.set_level(logging.WARNING, logger="trainer.checkpoint")
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the directory should be
    ck = Checkpointer(root=str(tmp_path / "ckpt"), mode=CheckpointMode.ASYNC, keep=2, pg=one_rank_world,
                      report=lambda *a, **k: None, memory=MemorySnapshot(), local_dir=str(blocker / "local"))
    assert ck.local is None and "node-local checkpoint copies off" in caplog.text
    state, _, _ = _app(0)
    ck.save(state, 2)
    ck.wait()
    ck.close()


def test_it_reports_the_steps_an_async_save_slowed_down_as_its_interference(tmp_path, one_rank_world):
    """Interference: the overlapping steps' extra time against the steps just before the save, without
    the blocked time; a sync save reports none (it only blocks)."""
    import time

    from trainer.checkpoint import BASELINE_STEPS, Checkpointer
    from trainer.wire import CheckpointMode

    events = []
    state, _, _ = _app(0)
    ck = Checkpointer(root=str(tmp_path), mode=CheckpointMode.ASYNC, keep=2, pg=one_rank_world,
                      report=lambda kind, data: events.append(data))

    def steps(n, seconds):
        for _ in range(n):
            time.sleep(seconds)
            ck.poll()

    def durable(step):
        return next(e for e in events if e["step"] == step and e["state"] == "durable")

    ck.poll()
    steps(BASELINE_STEPS, 0.02)
    ck.save(state, 10)
    ck.maybe_wait_for_staging()
    t0 = time.perf_counter()
    assert ck._in_flight.ended.wait(30)  # the save is durable; the step still runs slow
    waited = time.perf_counter() - t0  # the test's own wait for the write: part of this step too
    steps(1, 0.32)  # 0.3 s more than the steps before it
    assert ck._in_flight is None
    slow = durable(10)
    assert 0.25 <= slow["interference_s"] - waited <= 0.45, (slow, waited)

    steps(BASELINE_STEPS, 0.02)
    ck.save(state, 20)
    ck.maybe_wait_for_staging()
    t0 = time.perf_counter()
    assert ck._in_flight.ended.wait(30)
    waited_20 = time.perf_counter() - t0
    steps(1, 0.02)  # as fast as the steps before it
    assert durable(20)["interference_s"] - waited_20 < slow["interference_s"] - waited - 0.15

    ck.save(state, 30, mode=CheckpointMode.SYNC)
    assert "interference_s" not in durable(30)
    ck.close()


def test_its_shards_skip_the_zip_checksum_that_torch_load_never_checks_and_still_load(tmp_path,
                                                                                      one_rank_world):
    import io
    import zipfile

    import torch
    from torch.distributed.checkpoint import FileSystemReader

    from trainer.checkpoint import Checkpointer
    from trainer.wire import CheckpointMode

    state, model, _ = _app(0)
    saved = _weights(model)
    ck = Checkpointer(root=str(tmp_path), mode=CheckpointMode.ASYNC, keep=2, pg=one_rank_world,
                      report=lambda *a, **k: None)
    ck.save(state, 3, mode=CheckpointMode.SYNC)
    ck.save(state, 4)
    ck.wait()
    for step in (3, 4):
        path = step_dir(str(tmp_path), step)
        infos = FileSystemReader(path).read_metadata().storage_data.values()
        assert infos
        for info in infos:  # each tensor of a DCP shard is one torch.save zip at (offset, length)
            with open(f"{path}/{info.relative_path}", "rb") as f:
                f.seek(info.offset)
                entries = zipfile.ZipFile(io.BytesIO(f.read(info.length))).infolist()
            assert entries and all(e.CRC == 0 for e in entries), (
                step, info, [(e.filename, e.CRC) for e in entries])
    state2, model2, _ = _app(1)
    assert Checkpointer(root=str(tmp_path), mode=CheckpointMode.ASYNC, keep=2, pg=one_rank_world,
                        report=lambda *a, **k: None).load(state2) == 4
    assert all(a.equal(b) for a, b in zip(saved, _weights(model2), strict=True))
    ck.close()
    # The switch is set only around the write: the training thread's own torch.save keeps its checksums.
    buf = io.BytesIO()
    torch.save(torch.arange(4.0), buf)
    assert all(e.CRC != 0 for e in zipfile.ZipFile(buf).infolist() if e.file_size)


def test_a_save_after_a_restart_aborted_the_process_group_writes_nothing_durable(tmp_path, caplog):
    """NVRx's abort destroys the process groups a moment before it interrupts the main thread; a save called
    in between must not run as DCP's single-process save (one rank's shards, made durable by rank 0: every
    later restore fails with 'Missing key ... rank1')."""
    import torch.distributed as dist

    from trainer.checkpoint import Checkpointer
    from trainer.wire import CheckpointMode

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        state, _, _ = _app(0)
        ck = Checkpointer(root=str(tmp_path), mode=CheckpointMode.SYNC, keep=2, pg=dist.new_group(backend="gloo"),
                          report=lambda *a, **k: None)
    finally:
        dist.destroy_process_group()  # the abort
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
        ck.save(state, 80)
        ck.save(state, 80, mode=CheckpointMode.ASYNC)
    assert latest_durable(str(tmp_path)) is None and list_checkpoints(str(tmp_path)) == []
    assert "checkpoint of step 80 not saved: the process group is gone" in caplog.text


def test_an_async_save_whose_write_starts_after_the_abort_writes_nothing(tmp_path):
    """DCP's async executor runs the save in its own thread once staging ends: when a restart's abort
    destroyed the process groups in between, it must fail, not save as a single process (rank 0's
    .metadata naming only its shards, made durable: the demo's restarts then failed with
    'Missing key in checkpoint state_dict: app.rng/rank1' until the restart storm stopped the job)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from trainer.checkpoint import _Writer

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        state, _, _ = _app(0)
        pg = dist.new_group(backend="gloo")
    finally:
        dist.destroy_process_group()  # the abort, between the save's call and its executor's start
    path = tmp_path / "step_000000300"
    # What DCP's thread executor calls once the staged copy is ready (async_save's default no_dist).
    with pytest.raises(CheckpointException) as failed:
        dcp.save({"app": state}, checkpoint_id=str(path), storage_writer=_Writer(str(path)), process_group=pg)
    assert "the process group is gone" in repr(failed.value.failures)
    assert not (path / ".metadata").exists() and not list(path.glob("*.distcp"))


def test_a_durable_checkpoint_that_cannot_be_loaded_is_set_aside_for_the_newest_that_can(tmp_path, one_rank_world):
    """A checkpoint made durable but unloadable (here its shard is gone) would fail every restore until the
    restart storm stopped the job: the restore takes the newest older one that loads instead, sets the bad one
    aside and reports it. When none loads, the failure is raised and nothing is set aside."""
    from torch.distributed.checkpoint.api import CheckpointException

    from trainer.checkpoint import Checkpointer
    from trainer.nvrx_compat import ITERATION_FILE
    from trainer.wire import CheckpointMode

    events = []
    state, model, _ = _app(0)
    ck = Checkpointer(root=str(tmp_path), mode=CheckpointMode.SYNC, keep=3, pg=one_rank_world,
                      report=lambda kind, data: events.append(data))
    ck.save(state, 20)
    at_20 = _weights(model)
    model(__import__("torch").randn(3, 8)).sum().backward()
    state.optim.step()
    ck.save(state, 40)
    for shard in (tmp_path / "step_000000040").glob("*.distcp"):
        shard.unlink()

    fresh, model2, _ = _app(1)
    assert ck.load(fresh) == 20 and ck.restored_from == "disk"
    assert all(a.equal(b) for a, b in zip(at_20, _weights(model2), strict=True))
    assert [(s, d) for s, _, d in list_checkpoints(str(tmp_path))] == [(20, True)]
    aside = [p.name for p in tmp_path.iterdir() if p.name.startswith("step_000000040.unloadable-")]
    assert len(aside) == 1, list(tmp_path.iterdir())
    assert (tmp_path / ITERATION_FILE).read_text().strip() == "20"
    failed = [e for e in events if e["state"] == "failed"]
    assert len(failed) == 1 and failed[0]["step"] == 40 and failed[0]["attempt_key"].startswith("unloadable-")
    assert f"set aside as {aside[0]}; restored step 20 instead: rank 0: " in failed[0]["detail"]

    # None loads: the newest one's failure, and nothing set aside.
    for shard in (tmp_path / "step_000000020").glob("*.distcp"):
        shard.unlink()
    with pytest.raises(CheckpointException):
        ck.load(_app(2)[0])
    assert [(s, d) for s, _, d in list_checkpoints(str(tmp_path))] == [(20, True)]
