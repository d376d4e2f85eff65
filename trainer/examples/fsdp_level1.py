"""``plain_fsdp.py`` with the SDK's few lines (Level 1): every rank reports its steps and phases, so a
hung loop is detected from its heartbeats, and commands (stop, in-job restart, fault injection) act at
step boundaries. The lines marked ``# unbroken`` are all that changed; outside the product they do
nothing, so this still runs under plain ``torchrun``.

    torchrun --nproc-per-node 2 trainer/examples/fsdp_level1.py --steps 200
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import unbroken  # unbroken


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


def latest(ckpt_dir: str) -> int | None:
    done = [int(n[5:]) for n in os.listdir(ckpt_dir) if n.startswith("step_")
            and os.path.exists(os.path.join(ckpt_dir, n, "DONE"))]
    return max(done) if done else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--ckpt-dir", default=os.environ.get("UNBROKEN_CHECKPOINT_DIR", "checkpoints"))
    p.add_argument("--lr", type=float, default=1e-2)
    args = p.parse_args()

    dist.init_process_group("gloo")
    run = unbroken.init()  # unbroken
    rank = dist.get_rank()
    vocab = 128
    model = build_model(vocab, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    os.makedirs(args.ckpt_dir, exist_ok=True)

    start = 0
    found = [latest(args.ckpt_dir) if rank == 0 else None]
    dist.broadcast_object_list(found, src=0)
    if found[0] is not None:
        with run.phase("checkpoint_load"):  # unbroken
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=os.path.join(args.ckpt_dir, f"step_{found[0]}"))
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = found[0]
        print(f"resumed from step {start}", flush=True)

    loss = None
    for step in range(start, args.steps):
        x, y = batch(step, rank, vocab)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        run.step(step + 1, loss=loss.item())  # unbroken
        if rank == 0:
            print(f"step {step + 1} loss {loss.item():.5f}", flush=True)
        if (step + 1) % args.ckpt_every == 0:
            with run.phase("checkpoint_save"):  # unbroken
                path = os.path.join(args.ckpt_dir, f"step_{step + 1}")
                msd, osd = get_state_dict(model, opt)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
                dist.barrier()
                if rank == 0:
                    open(os.path.join(path, "DONE"), "w").close()
        if run.stop_requested():  # unbroken (a real script would all-reduce it: see Run.stop_requested)
            break
    if rank == 0 and loss is not None:  # None: resumed from a checkpoint of the last step, nothing left
        print(f"FINAL_LOSS {loss.item()!r}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
