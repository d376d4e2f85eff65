"""The workload of ``bench_sdk.py``: the FSDP2 model of ``trainer/examples/fsdp_level2.py`` trained
either as a plain loop (``--plain``) or through the SDK's full level, timing each step and, in SDK
mode, the time spent inside the SDK's per-step calls. Writes ``<out>/rank<R>.json``."""

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict

import unbroken

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("fsdp_level2", ROOT / "trainer" / "examples" / "fsdp_level2.py")
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)


def args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--out", required=True)
    p.add_argument("--plain", action="store_true")
    p.add_argument("--ckpt-every", type=int, default=20, help="plain mode: sync DCP saves this often")
    p.add_argument("--alternate", type=int, default=0,
                   help="SDK mode: skip the SDK's per-step calls in every other window of this many steps "
                        "(the same processes and threads run either way: an A/B of the calls alone)")
    return p.parse_args()


def loop(a, rank, model, opt, start, sdk) -> None:
    vocab = 512
    step_s, sdk_s, saved, calls = [], [], [], []
    t_prev = time.perf_counter()
    for step in range(start, a.steps):
        x, y = example.batch(step, rank, vocab, n=512)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        on = sdk is not None and not (a.alternate and (step // a.alternate) % 2)
        t_sdk = time.perf_counter()
        if on:
            sdk.checkpoint.wait_for_staging()
        spent = time.perf_counter() - t_sdk
        opt.step()
        opt.zero_grad()
        t_sdk = time.perf_counter()
        did_save = False
        if on:
            sdk.step(step + 1, loss=loss.item())
            did_save = sdk.checkpoint.maybe_save(step + 1)
        elif sdk is not None:
            loss.item()
        else:
            loss.item()  # the same host sync the SDK call implies
            if (step + 1) % a.ckpt_every == 0:  # the plain script checkpoints itself (sync DCP)
                msd, osd = get_state_dict(model, opt)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(a.out, f"ckpt_{step + 1}"))
                did_save = True
        spent += time.perf_counter() - t_sdk
        now = time.perf_counter()
        step_s.append(now - t_prev)
        sdk_s.append(spent)
        saved.append(did_save)
        calls.append(on)
        t_prev = now
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"rank{rank}.json").write_text(json.dumps({"step_s": step_s, "sdk_s": sdk_s, "saved": saved, "calls": calls, "async": sdk is not None,
                                                               "threads": torch.get_num_threads()}))


def build(d: int):
    torch.manual_seed(0)
    model = example.build_model(512, d)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


@unbroken.entrypoint
def with_sdk(ctx: unbroken.Context) -> None:
    a = args()
    ctx.init_process_group()
    model, opt = build(a.d)
    start = ctx.checkpoint.restore(model=model, optim=opt)
    loop(a, ctx.rank, model, opt, start, ctx)


def plain() -> None:
    a = args()
    dist.init_process_group("gloo")
    model, opt = build(a.d)
    loop(a, dist.get_rank(), model, opt, 0, None)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if os.environ.get("BENCH_SWITCH"):
        import sys

        sys.setswitchinterval(float(os.environ["BENCH_SWITCH"]))
    if "--plain" in os.sys.argv:
        plain()
    else:
        with_sdk()
