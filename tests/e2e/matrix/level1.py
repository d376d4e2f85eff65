"""Level 1: ``level0.py`` with the SDK's few lines (steps and phases)."""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
import unbroken

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import inject  # noqa: E402


def latest(d: str) -> int | None:
    """The newest finished save; MATRIX_NAIVE_RESUME=1: the newest directory, finished or not (a torn save
    is then loaded on every restart)."""
    naive = os.environ.get("MATRIX_NAIVE_RESUME") == "1"
    done = [int(n[5:]) for n in os.listdir(d) if n.startswith("step_")
            and (naive or os.path.exists(os.path.join(d, n, "DONE")))]
    return max(done) if done else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--ckpt-dir", default=os.environ.get("UNBROKEN_CHECKPOINT_DIR", "checkpoints"))
    args = p.parse_args()
    dist.init_process_group("gloo")
    run = unbroken.init()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    os.makedirs(args.ckpt_dir, exist_ok=True)
    found = [latest(args.ckpt_dir) if rank == 0 else None]
    dist.broadcast_object_list(found, src=0)
    start = 0
    if found[0] is not None:
        with run.phase("checkpoint_load"):
            state = {"model": model.state_dict()}
            dcp.load(state, checkpoint_id=os.path.join(args.ckpt_dir, f"step_{found[0]}"))
            model.load_state_dict(state["model"])
        start = found[0]
        print(f"resumed from step {start}", flush=True)
    for step in range(start, args.steps):
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(step * 10 + rank))
        loss = F.mse_loss(model(x), x)
        loss.backward()
        for q in model.parameters():
            dist.all_reduce(q.grad)
        opt.step()
        opt.zero_grad()
        time.sleep(0.05)
        run.step(step + 1, loss=loss.item())
        if rank == 0:
            print(f"step {step + 1} loss {loss.item():.5f}", flush=True)
        if run.stop_requested():
            break
        inject.at_step(step + 1, rank)
        if (step + 1) % args.ckpt_every == 0:
            with run.phase("checkpoint_save"):
                path = os.path.join(args.ckpt_dir, f"step_{step + 1}")
                inject.during_save(step + 1, rank)
                dcp.save({"model": model.state_dict()}, checkpoint_id=path)
                dist.barrier()
                if rank == 0:
                    open(os.path.join(path, "DONE"), "w").close()
    if rank == 0:
        print(f"FINAL_LOSS {loss.item()!r}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
