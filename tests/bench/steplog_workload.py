"""The built-in demo job's training (``trainer/examples/synthetic.py``, the tiny preset) as a bench's own
entrypoint, through the SDK's public API only, with one addition: each rank appends every step it
completes to its own log, ``$BENCH_STEP_LOG_DIR/rank<R>.log`` (``<step> <pid> <unix time>`` a line,
written and flushed before ``ctx.step``, where a drill fires). ``make bench-chaos`` counts the steps each
rank ran twice from it: an independent count of the steps lost, which does not read the cycle marks the
control plane folds.

    spec: {"entrypoint": "<repo>/tests/bench/steplog_workload.py", "args": ["--steps", "700"],
           "env": {"BENCH_STEP_LOG_DIR": "/tmp/steps"}, ...}
"""

import argparse
import os
import time

import torch
import torch.nn.functional as F

import unbroken
from trainer.examples.synthetic import PRESETS, build_model, make_batch


@unbroken.entrypoint
def train(ctx: unbroken.Context) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    args = p.parse_args()
    preset = PRESETS[args.preset]
    ctx.init_process_group()
    model = build_model(preset, seed=0, device=ctx.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = ctx.checkpoint.restore(model=model, optim=optimizer)
    path = os.path.join(os.environ["BENCH_STEP_LOG_DIR"], f"rank{ctx.rank}.log")
    with open(path, "a", buffering=1, encoding="ascii") as steps:  # line-buffered: a line per write
        for step in range(start, args.steps):
            x, y = make_batch(preset, seed=0, step=step, rank=ctx.rank, batch_size=preset.batch_size,
                              device=ctx.device)
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss_v = loss.item()
            loss.backward()
            ctx.checkpoint.wait_for_staging()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            steps.write(f"{step + 1} {os.getpid()} {time.time():.3f}\n")  # completed; a drill may fire next
            ctx.step(step + 1, loss=loss_v, tokens=x.numel())
            if step + 1 == args.steps or ctx.should_stop():
                ctx.checkpoint.save(step + 1, sync=True)
                break
            ctx.checkpoint.maybe_save(step + 1)


if __name__ == "__main__":
    train()
