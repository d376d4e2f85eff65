"""Level 0: an unmodified torchrun script (gloo, its own DCP saves) with one injected failure."""

import os
import sys

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import inject
import toy


def main() -> None:
    args = toy.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, opt = toy.model_and_optimizer()
    os.makedirs(args.ckpt_dir, exist_ok=True)
    found = [toy.latest(args.ckpt_dir) if rank == 0 else None]
    dist.broadcast_object_list(found, src=0)
    start = 0
    if found[0] is not None:
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=toy.step_dir(args.ckpt_dir, found[0]))
        model.load_state_dict(state["model"])
        start = found[0]
        print(f"resumed from step {start}", flush=True)
    for step in range(start, args.steps):
        loss = toy.loss_of(model, step, rank)
        toy.update(opt)
        if rank == 0:
            print(f"step {step + 1} loss {loss.item():.5f}", flush=True)
        inject.at_step(step + 1, rank)
        if (step + 1) % args.ckpt_every == 0:
            path = toy.step_dir(args.ckpt_dir, step + 1)
            inject.during_save(step + 1, rank)
            dcp.save({"model": model.state_dict()}, checkpoint_id=path)
            toy.mark_done(path, rank)
    if rank == 0:
        print(f"FINAL_LOSS {loss.item()!r}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
