"""``plain_fsdp.py`` at the SDK's full level (Level 2): the training function is what every restart
re-enters, so an exception or a NaN loss restarts it in the same processes (NVRx in-process restart)
and a killed rank restarts the group (ft_launcher), both resuming through the same
``ctx.checkpoint.restore``; checkpoints are the product's async DCP saves at the job's interval.
Under plain ``torchrun`` it trains without checkpoints (the SDK then only creates the process group).

    torchrun --nproc-per-node 2 trainer/examples/fsdp_level2.py --steps 200
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

import unbroken


def build_model(vocab: int, d: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(vocab, d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d),
                          nn.LayerNorm(d), nn.Linear(d, vocab))
    for layer in (model[1], model[3]):
        fully_shard(layer)
    fully_shard(model)
    return model


def batch(step: int, rank: int, vocab: int, n: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randint(0, vocab, (n,), generator=g)
    return x, (x * 5 + 3) % vocab


@unbroken.entrypoint
def train(ctx: unbroken.Context) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-2)
    args = p.parse_args()

    ctx.init_process_group()
    vocab = 128
    model = build_model(vocab, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start = ctx.checkpoint.restore(model=model, optim=opt)

    loss = None
    for step in range(start, args.steps):
        x, y = batch(step, ctx.rank, vocab)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        ctx.checkpoint.wait_for_staging()
        opt.step()
        opt.zero_grad()
        ctx.step(step + 1, loss=loss.item())
        ctx.checkpoint.maybe_save(step + 1)
        if ctx.rank == 0 and (step + 1) % 10 == 0:
            print(f"step {step + 1} loss {loss.item():.5f}", flush=True)
        if ctx.should_stop():
            ctx.checkpoint.save(step + 1, sync=True)
            break
    if ctx.rank == 0 and loss is not None:
        print(f"FINAL_LOSS {loss.item()!r}", flush=True)


if __name__ == "__main__":
    train()
