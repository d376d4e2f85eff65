"""The workload of ``bench_sdk.py``: the Llama-style decoder of ``trainer/examples/llama_level2.py``
(``--model llama``, the default) or the small FSDP2 model of ``trainer/examples/fsdp_level2.py``
(``--model mlp``), trained either as a plain loop (``--plain``) or through the SDK's full level, timing
each step (its end on the system's monotonic clock, which the bench's time slicing reads too) and, in
SDK mode, the time spent inside the SDK's per-step calls. Writes ``<out>/rank<R>.json``."""

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


def _example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "trainer" / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--model", choices=("llama", "mlp"), default="llama")
    p.add_argument("--d", type=int, default=256, help="--model mlp: its width")
    p.add_argument("--out", required=True)
    p.add_argument("--plain", action="store_true")
    p.add_argument("--ckpt-every", type=int, default=20, help="plain mode: sync DCP saves this often")
    p.add_argument("--alternate", type=int, default=0,
                   help="SDK mode: skip the SDK's per-step calls in every other window of this many steps "
                        "(the same processes and threads run either way: an A/B of the calls alone)")
    return p.parse_args()


class Workload:
    """The model, its optimizer and a step's loss, for either example."""

    def __init__(self, a: argparse.Namespace):
        self.a = a
        if a.model == "llama":
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            self.ex = _example("llama_level2")
            self.data = torch.frombuffer(bytearray(self.ex.CORPUS.read_bytes()), dtype=torch.uint8).long()
            self.model = self.ex.build_model(64)
        else:
            self.ex = _example("fsdp_level2")
            torch.manual_seed(0)
            self.model = self.ex.build_model(512, a.d)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def loss(self, step: int, rank: int) -> torch.Tensor:
        if self.a.model == "llama":
            ids = self.ex.batch(self.data, step, rank, 4, 64)
            return self.model(input_ids=ids, labels=ids).loss
        x, y = self.ex.batch(step, rank, 512, n=512)
        return F.cross_entropy(self.model(x), y)


def loop(a, rank, w: Workload, start, sdk) -> None:
    model, opt = w.model, w.opt
    step_s, sdk_s, saved, calls, ends, cpu, overlap = [], [], [], [], [], [], []
    t_prev = time.perf_counter()
    for step in range(start, a.steps):
        loss = w.loss(step, rank)
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
        # An async save still being written during this step (checked before ctx.step, whose poll lets go
        # of a save that ended): the product books the step's extra time to the save as its interference.
        overlap.append(sdk is not None and sdk.checkpoint.in_flight)
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
        ends.append(time.monotonic())
        cpu.append(time.thread_time())  # the loop thread's own CPU: on-CPU work vs waiting
        step_s.append(now - t_prev)
        sdk_s.append(spent)
        saved.append(did_save)
        calls.append(on)
        t_prev = now
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"rank{rank}.json").write_text(json.dumps({
        "step_s": step_s, "sdk_s": sdk_s, "saved": saved, "calls": calls, "end": ends, "cpu": cpu,
        "overlap": overlap, "async": sdk is not None, "threads": torch.get_num_threads()}))


@unbroken.entrypoint
def with_sdk(ctx: unbroken.Context) -> None:
    a = args()
    ctx.init_process_group()
    w = Workload(a)
    start = ctx.checkpoint.restore(model=w.model, optim=w.opt)
    loop(a, ctx.rank, w, start, ctx)


def plain() -> None:
    a = args()
    dist.init_process_group("gloo")
    loop(a, dist.get_rank(), Workload(a), 0, None)
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
