"""Level 2: the same training as an SDK entrypoint (re-entered by every restart; the product's async
saves)."""

import argparse
import os
import sys

import unbroken

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import inject
import toy


@unbroken.entrypoint
def train(ctx: unbroken.Context) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    args, _ = p.parse_known_args()
    ctx.init_process_group()
    model, opt = toy.model_and_optimizer()
    start = ctx.checkpoint.restore(model=model, optim=opt)
    for step in range(start, args.steps):
        loss = toy.loss_of(model, step, ctx.rank)
        ctx.checkpoint.wait_for_staging()
        toy.update(opt)
        ctx.step(step + 1, loss=loss.item())
        inject.at_step(step + 1, ctx.rank)
        if ctx.checkpoint.maybe_save(step + 1):
            inject.during_save(step + 1, ctx.rank)  # the async save is writing now
        if ctx.rank == 0 and (step + 1) % 10 == 0:
            print(f"step {step + 1} loss {loss.item():.5f}", flush=True)
        if ctx.should_stop():
            break


if __name__ == "__main__":
    train()
