"""The saver process that writes async checkpoints: low priority, dies with its rank, never re-runs the
user's script, and a rank whose saver is gone starts a new one with every other rank."""

import subprocess
import time

import psutil
import pytest

from tests.trainer.conftest import PYTHON, ROOT, child_env
from trainer.checkpoint_saver import saver_process_available

pytestmark = pytest.mark.skipif(not saver_process_available(), reason="this torch has no process-based DCP saver")

# Run as the shim runs a user's script (runpy, as __main__): its top level must run once, in the rank only.
SCRIPT = """
import os, signal, sys
with open(os.environ["MARK"], "a") as f:
    f.write(f"{os.getpid()}\\n")
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from trainer.checkpoint import Checkpointer
from trainer.checkpoint_layout import latest_durable
from trainer.fullrun import _AppState
from trainer.wire import CheckpointMode
import torch.distributed.checkpoint._async_process_executor as ape

if __name__ == "__main__":
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    state = _AppState(model=model, optim=opt, extra={}, rank=0)
    ck = Checkpointer(root=sys.argv[1], mode=CheckpointMode.ASYNC, keep=2, pg=dist.new_group(backend="gloo"),
                      report=lambda *a: None, saver=True)
    assert ck.saver
    ck.save(state, 5)
    ck.wait()
    ck.save(state, 10)  # the second save sends the saver only what changed
    ck.wait()
    pid = ape._CHECKPOINT_PROCESS._save_process.pid
    print("durable", latest_durable(sys.argv[1]), "rank", os.getpid(), "saver", pid,
          os.getpriority(os.PRIO_PROCESS, pid),
          os.sched_getscheduler(pid) == os.SCHED_IDLE, flush=True)
    os.kill(os.getpid(), signal.SIGKILL if sys.argv[2] == "kill" else signal.SIGTERM)
"""


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("how", ["kill", "term"])
def test_the_saver_runs_at_low_priority_never_reruns_the_script_and_dies_with_its_rank(tmp_path, how):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    mark = tmp_path / "mark"
    env = dict(child_env(), MARK=str(mark), MASTER_ADDR="127.0.0.1")
    p = subprocess.run([PYTHON, "-c", f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')",
                        str(tmp_path / "ck"), how], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("durable")), None)
    assert line, p.stdout + p.stderr
    _, durable, _, rank_pid, _, pid, nice, idle = line.split()
    assert durable == "10" and nice == "19" and idle == "True"
    assert mark.read_text().split() == [rank_pid]  # the spawned saver did not run the script's top level
    assert _gone(int(pid), within_s=10), f"saver {pid} outlived its rank ({how})"


@pytest.fixture
def one_rank_world(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.new_group(backend="gloo")
    from trainer.checkpoint_saver import stop_saver

    stop_saver()
    dist.destroy_process_group()


def test_a_dead_saver_fails_the_save_and_the_next_attempt_starts_a_new_one(tmp_path, one_rank_world):
    from tests.trainer.test_checkpoint import _app, _weights
    from trainer.checkpoint import Checkpointer
    from trainer.checkpoint_layout import latest_durable
    from trainer.checkpoint_saver import stop_saver
    from trainer.wire import CheckpointMode

    state, model, _ = _app(0)
    ck = Checkpointer(root=str(tmp_path), mode=CheckpointMode.ASYNC, keep=2, pg=one_rank_world,
                      report=lambda *a: None, saver=True)
    ck.save(state, 5)
    ck.wait()
    stop_saver()  # as if it had died
    with pytest.raises(RuntimeError, match="saver process died"):
        ck.save(state, 10)
    # The next attempt (an in-process restart) agrees on it in load() and starts a new one at its first save.
    state2, model2, _ = _app(1)
    ck2 = Checkpointer(root=str(tmp_path), mode=CheckpointMode.ASYNC, keep=2, pg=one_rank_world,
                       report=lambda *a: None, saver=True)
    assert ck2.load(state2) == 5 and all(a.equal(b) for a, b in zip(_weights(model), _weights(model2), strict=True))
    ck2.save(state2, 15)
    ck2.wait()
    assert latest_durable(str(tmp_path)) == 15
