"""The matrix's training, shared by its level-0 and level-1 scripts (level 2 shares the model): a linear
layer fitted on seeded noise, with the loop's step and its DCP save directories. One copy, so that the levels
differ only in what they add (the SDK's lines), never in the training the matrix compares."""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--ckpt-dir", default=os.environ.get("UNBROKEN_CHECKPOINT_DIR", "checkpoints"))
    return p.parse_args()


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def loss_of(model: torch.nn.Module, step: int, rank: int) -> torch.Tensor:
    """Forward and backward on this rank's batch for ``step``, gradients summed over the ranks."""
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(step * 10 + rank))
    loss = F.mse_loss(model(x), x)
    loss.backward()
    for q in model.parameters():
        dist.all_reduce(q.grad)
    return loss


def update(opt: torch.optim.Optimizer) -> None:
    """The optimizer step, then the sleep that makes a step long enough to fail inside."""
    opt.step()
    opt.zero_grad()
    time.sleep(0.05)


def latest(d: str, *, naive: bool = False) -> int | None:
    """The newest finished save (its ``DONE`` written); ``naive``: the newest directory, finished or not."""
    done = [int(n[5:]) for n in os.listdir(d) if n.startswith("step_")
            and (naive or os.path.exists(os.path.join(d, n, "DONE")))]
    return max(done) if done else None


def step_dir(d: str, step: int) -> str:
    return os.path.join(d, f"step_{step}")


def mark_done(path: str, rank: int) -> None:
    """After every rank's part of the save: rank 0 marks it finished."""
    dist.barrier()
    if rank == 0:
        open(os.path.join(path, "DONE"), "w").close()
