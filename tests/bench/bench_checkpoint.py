"""Checkpoint benchmark: the `small` preset (~160 MB of model + AdamW state across 2 ranks, gloo on CPU).

One run, 2 ranks: sync saves and async saves (the trainer's Checkpointer: own gloo group, THREAD
executor, persistent stager with background staging, wait before optimizer.step), then throughput in
alternating 10-step windows with no save and with one async save (= a save every 10 steps; the save
must complete inside its window). Medians over the repeats (pairs); efficiency is the median of the
paired window ratios (no save / with save), which cancels most drift from other load on the machine.

The whole cost of a save to the loop: ``async_total_s`` is the median of the paired window
differences (with save - no save), i.e. what the async save blocked plus its interference (the extra
time of the steps that overlapped the background save); ``sync_total_s`` is what a sync save blocks.
Every figure is printed with its spread (min..max over the pairs).

    python tests/bench/bench_checkpoint.py [--repeats 9] [--controls 5]

``--controls N`` adds N pairs of windows without and with an idle-priority load on each rank as big as
a sync save's CPU, once burning CPU only and once copying memory: whether this machine's steps pay
for a background save's CPU or for its memory traffic.

**GPU-shaped window (emulated device time).** Here two ranks fill both cores, so whatever an async save
does comes out of the steps. On a GPU node a step is mostly device time, in which the host thread waits
and its cores idle. So the same model state and saves run once more with each step's compute followed
by a ``time.sleep`` (it releases the GIL) standing for device time, sized to the median CPU step
measured here (``--device-share`` of the step, 0.5 by default: the ranks leave about half of the host's
CPU idle; the idle cores measured are printed). ``--gpu-repeats`` triples of one async save, one sync
save and the same steps with no save (a control: the method's own noise; each goes first in turn), each
timed step by step: the save call, plus each later step's time over
the median of the 4 steps just before the save, until the save is written and one step more.
``gpu_shaped_async_total_s`` and ``gpu_shaped_sync_total_s`` are the medians. (A first version took
differences of whole 10-step windows: this VM's step time drifts by more than a save costs over 19 s.) No
GPU is involved: the device time is emulated. The async saves there run where the product runs them (DCP's
THREAD executor; ``UNBROKEN_CKPT_SAVER=process``: the saver process), which the output names.

Then (medians by nearest rank with min..max and n, tests/bench/stats.py)::

    sync_block_s=<X> async_block_s=<Y> block_ratio=<Y/X> efficiency=<E> async_total_s=<T> sync_total_s=<S> \
gpu_shaped_async_total_s=<GA> gpu_shaped_sync_total_s=<GS> gpu_shaped_ratio=<GA/GS> n=<N> n_gpu_shaped=<M>

and the README row's targets, each met or MISSED (exit status 1 when one is): block_ratio <= 0.05,
efficiency >= 0.98, async_total_s <= 0.5 x sync_total_s, and (emulated device time)
gpu_shaped_async_total_s <= 0.3 x gpu_shaped_sync_total_s.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench.stats import Target, median, verdict  # noqa: E402

#: A control load (``--controls``): a process at idle CPU priority that burns ``seconds`` of CPU, either
#: in a pure-Python loop (no memory traffic) or copying an 80 MB buffer (a save's staging and write
#: stream about that much per rank). On a machine whose steps are bound by memory bandwidth, the copy
#: slows the steps even though it only runs on idle CPU time, and the loop does not.
CONTROL = """
import os, sys, time
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
kind, seconds = sys.argv[1], float(sys.argv[2])
if kind == "copy":  # only here: zeroing the buffers is memory traffic too
    src = bytearray(80 << 20)
    dst = bytearray(len(src))
t = time.process_time()
while time.process_time() - t < seconds:
    if kind == "copy":
        dst[:] = src
    else:
        x = 0
        for i in range(100_000):
            x += i
"""


#: GPU-shaped saves: steps timed before each save (its baseline), steps counted after it is written, and
#: the most steps an async save may overlap before the rest of its write counts as a wait.
GPU_BASE_STEPS, GPU_AFTER_STEPS, GPU_MAX_OVERLAP_STEPS = 4, 1, 20


def worker(run_dir: str, repeats: int, window: int, controls: int, gpu_repeats: int,
           device_share: float) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from trainer.checkpoint import Checkpointer
    from trainer.examples.synthetic import PRESETS, build_model, make_batch
    from trainer.fullrun import _AppState
    from trainer.wire import CheckpointMode

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ckpt_pg = dist.new_group(backend="gloo")
    preset = PRESETS["small"]
    model = build_model(preset, seed=0, device=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = _AppState(model=model, optim=opt, extra={}, rank=rank)  # what the SDK saves
    events: list[dict] = []
    ck = Checkpointer(root=os.path.join(run_dir, "checkpoints"), mode=CheckpointMode.ASYNC, keep=2, pg=ckpt_pg,
                      report=lambda kind, data: events.append(data))
    step = 0
    device_s = 0.0  # emulated device time per step (the GPU-shaped window sets it)

    def train_step() -> None:
        nonlocal step
        x, y = make_batch(preset, seed=0, step=step, rank=rank, batch_size=preset.batch_size,
                          device=torch.device("cpu"))
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.item()
        loss.backward()
        if device_s:
            time.sleep(device_s)  # emulated device time: the host thread waits, the GIL is free
        ck.maybe_wait_for_staging()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        ck.poll()

    def plain_window() -> float:
        """A window of steps with nothing beside them, all ranks starting together: its wall time."""
        dist.barrier()
        t = time.perf_counter()
        for _ in range(window):
            train_step()
        return time.perf_counter() - t

    for _ in range(3):
        train_step()
    # Warm the persistent stager (first async save allocates its buffers), as a long run would be.
    ck.save(state, step)
    for _ in range(3):
        train_step()
    ck.wait()

    sync_block, sync_cpu, sync_idle = [], [], []
    for _ in range(repeats):
        dist.barrier()
        idle0, c, t = _idle_s(), time.process_time(), time.perf_counter()
        ck.save(state, step, mode=CheckpointMode.SYNC)
        sync_block.append(time.perf_counter() - t)
        sync_cpu.append(time.process_time() - c)  # every thread of this rank (DCP's writers included)
        sync_idle.append((_idle_s() - idle0) / sync_block[-1])  # idle cores of the machine meanwhile
        train_step()

    if rank == 0:
        print(f"sync saves done ({len(sync_block)})", flush=True)
    # Pairs: a window with no save, then a window with one async save, alternating.
    plain, with_save, async_block, async_interf = [], [], [], []
    for _ in range(repeats):
        plain.append(plain_window())
        dist.barrier()
        n_events = len(events)
        t = time.perf_counter()
        ck.save(state, step)
        for _ in range(window):
            train_step()
        ck.wait()
        with_save.append(time.perf_counter() - t)
        if rank == 0:
            durable = [e for e in events[n_events:] if e["state"] == "durable"]
            async_block.append(durable[-1]["blocking_s"])
            async_interf.append(durable[-1].get("interference_s"))

    # The GPU-shaped window (emulated device time): each step's compute is followed by a sleep of
    # device_share / (1 - device_share) of its CPU time; triples of windows, no save / async / sync.
    step_cpu = []
    for _ in range(window):
        c = time.thread_time()
        train_step()
        step_cpu.append(time.thread_time() - c)
    if rank == 0:
        print(f"async pairs done ({len(plain)})", flush=True)
    device_s = median(step_cpu) * device_share / (1 - device_share)
    dist.broadcast_object_list(box := [device_s], src=0)
    device_s = box[0]  # the same on every rank, or the ranks would wait for each other instead
    gpu_base, gpu_async, gpu_sync, gpu_idle, gpu_overlap = [], [], [], [], []

    def timed_step() -> float:
        t = time.perf_counter()
        train_step()
        return time.perf_counter() - t

    def gpu_save_cost(mode: CheckpointMode | None) -> float:
        """One save's whole cost to the loop, step by step: the save call, plus each following step's
        time over the median of the BASE steps just before it, until the save is written and AFTER steps
        more (a sync save is written when the call returns). Per-step, against the steps seconds before,
        because this machine's step time drifts by more than a save costs over a window of steps.
        ``mode`` None: the same steps and sums with no save (the method's own noise and bias)."""
        dist.barrier()
        idle0, t0 = _idle_s(), time.perf_counter()
        base = [timed_step() for _ in range(GPU_BASE_STEPS)]
        if mode is None:
            gpu_idle.append((_idle_s() - idle0) / (time.perf_counter() - t0))
        baseline = median(base)
        gpu_base.append(baseline)
        cpu0 = _thread_cpu()
        t = time.perf_counter()
        if mode is not None:
            ck.save(state, step, mode=mode)
        call = time.perf_counter() - t
        during, after = [], []
        while ck.in_flight and len(during) < GPU_MAX_OVERLAP_STEPS:
            during.append(timed_step() - baseline)
        for _ in range(GPU_AFTER_STEPS):
            after.append(timed_step() - baseline)
        t = time.perf_counter()
        ck.wait()  # written already (or the overlap cap was hit: the rest of the wait counts)
        waited = time.perf_counter() - t
        cpu1 = _thread_cpu()
        steps = len(during) + len(after)
        gpu_thread_cpu[mode].append(({k: (cpu1[k] - cpu0.get(k, 0.0)) / steps for k in cpu1}, steps))
        gpu_parts[mode].append((call, sum(during), sum(after), waited))
        if mode == CheckpointMode.ASYNC:
            gpu_overlap.append(len(during))
        return call + sum(during) + sum(after) + waited

    gpu_parts: dict[CheckpointMode | None, list[tuple[float, float, float, float]]] = {
        CheckpointMode.ASYNC: [], CheckpointMode.SYNC: [], None: []}
    gpu_none: list[float] = []
    # Per save: each thread's CPU per step (this rank's threads and its child processes, the saver's),
    # from the save call to the save written + AFTER steps, and the number of those steps.
    gpu_thread_cpu: dict[CheckpointMode | None, list[tuple[dict[str, float], int]]] = {
        CheckpointMode.ASYNC: [], CheckpointMode.SYNC: [], None: []}
    for i in range(gpu_repeats):
        order = ((CheckpointMode.ASYNC, gpu_async), (CheckpointMode.SYNC, gpu_sync), (None, gpu_none))
        for mode, out in order[i % 3:] + order[:i % 3]:  # each goes first as often as the others
            out.append(gpu_save_cost(mode))
    gpu_device_s, device_s = device_s, 0.0
    ck.close()

    # Controls: windows without and with an idle-priority load on each rank as big as a sync save's CPU.
    control: dict[str, list[float]] = {"cpu": [], "copy": []}
    for kind in control if controls else ():
        seconds = median(sync_cpu)
        for _ in range(controls):
            plain_s = plain_window()
            dist.barrier()
            t = time.perf_counter()
            load = subprocess.Popen([sys.executable, "-c", CONTROL, kind, f"{seconds:.3f}"])
            for _ in range(window):
                train_step()
            load.wait()
            control[kind].append(time.perf_counter() - t - plain_s)
    if rank == 0:
        def spread(xs: list[float], nd: int = 4) -> str:
            return f"median {median(xs):.{nd}f} (min {min(xs):.{nd}f}, max {max(xs):.{nd}f}, n={len(xs)})"

        state_mb = sum(os.path.getsize(os.path.join(d, f)) for d in [os.path.join(run_dir, "checkpoints",
                       sorted(os.listdir(os.path.join(run_dir, "checkpoints")))[-1])]
                       for f in os.listdir(d)) / 1e6
        ratios = [pl / ws for pl, ws in zip(plain, with_save, strict=True)]
        deltas = [ws - pl for pl, ws in zip(plain, with_save, strict=True)]
        print(f"checkpoint size {state_mb:.0f} MB; step {median(plain) / window:.3f} s", flush=True)
        print(f"sync blocking   {[round(x, 3) for x in sync_block]}", flush=True)
        print(f"async blocking  {[round(x, 4) for x in async_block]}", flush=True)
        print(f"{window} steps, no save      {[round(x, 2) for x in plain]}", flush=True)
        print(f"{window} steps, 1 async save {[round(x, 2) for x in with_save]}", flush=True)
        print(f"sync block s      {spread(sync_block)}", flush=True)
        # What async can hide is the save's waiting, not its CPU: with no idle core, the CPU a save
        # needs comes out of the steps whatever thread, process or priority runs it.
        print(f"sync save CPU s   {spread(sync_cpu)}  (rank 0, all its threads; CPU/wall "
              f"{median(sync_cpu) / median(sync_block):.2f})", flush=True)
        print(f"idle cores        {spread(sync_idle, 2)}  (machine-wide, during the sync saves; "
              f"{os.cpu_count()} cores)", flush=True)
        print(f"async block s     {spread(async_block)}", flush=True)
        print(f"efficiency        {spread(ratios)}", flush=True)
        print(f"async total s     {spread(deltas)}  (window with save - window without)", flush=True)
        if all(x is not None for x in async_interf):
            print(f"reported interf s {spread(async_interf)}  (the trainer's own per-save figure)", flush=True)
        s, a = median(sync_block), median(async_block)
        # Paired windows (adjacent in time) cancel most of the drift from other load on the machine.
        eff = median(ratios)
        total = median(deltas)
        if controls:
            print(f"idle-priority load of {median(sync_cpu):.3f} s CPU per rank (a sync save's), "
                  "window with it - window without:", flush=True)
            print(f"  CPU only        {spread(control['cpu'])}", flush=True)
            print(f"  copying memory  {spread(control['copy'])}", flush=True)
        ga, gs = median(gpu_async), median(gpu_sync)
        print(f"GPU-shaped steps (EMULATED device time: a {gpu_device_s * 1e3:.0f} ms sleep after each "
              f"step's {median(step_cpu) * 1e3:.0f} ms of CPU compute, device share {device_share:.2f}; "
              f"no GPU; async saves in {'the saver process' if ck.saver else 'DCP THREAD executor'}):",
              flush=True)
        print(f"  idle cores      {spread(gpu_idle, 2)}  (machine-wide, in the steps before a save; "
              f"{os.cpu_count()} cores)", flush=True)
        print(f"  step s          {spread(gpu_base)}  (median of the {GPU_BASE_STEPS} steps before each save)",
              flush=True)
        print(f"  async total s   {spread(gpu_async)}  (the save call + each step's excess until written, "
              f"+{GPU_AFTER_STEPS}; steps it overlapped: {spread(gpu_overlap, 0)})", flush=True)
        print(f"  sync total s    {spread(gpu_sync)}  (the save call + the next {GPU_AFTER_STEPS} steps' excess)",
              flush=True)
        print(f"  no save s       {spread(gpu_none)}  (the same sums with no save: the method's noise and bias)",
              flush=True)
        for mode, parts in gpu_parts.items():
            print(f"  {mode or 'none':5} parts (call, steps while written, after, wait): "
                  + "; ".join(", ".join(f"{x:.3f}" for x in p) for p in parts), flush=True)
        # Where an async save's CPU goes: each thread's CPU per step with the save against the same steps
        # with no save, times the steps the save spanned (rank 0; /proc, 10 ms ticks summed over the steps).
        runs = gpu_thread_cpu[CheckpointMode.ASYNC]
        keys = sorted({k for per_step, _ in runs for k in per_step})
        no_save = {k: median([n.get(k, 0.0) for n, _ in gpu_thread_cpu[None]]) for k in keys}
        excess = {k: median([(per_step.get(k, 0.0) - no_save[k]) * n_steps for per_step, n_steps in runs])
                  for k in keys}
        shown = sorted((k for k in keys if abs(excess[k]) >= 0.01), key=lambda k: -excess[k])
        print("  async save's CPU by thread (s per save over the same steps without one; rank 0, "
              "name:tid, child: the saver process): "
              + ", ".join(f"{k} {excess[k]:+.3f}" for k in shown), flush=True)
        print(f"load average {os.getloadavg()}", flush=True)
        figures = {"block_ratio": a / s, "efficiency": eff, "async_total_ratio": total / s,
                   "gpu_shaped_ratio": ga / gs}
        print(f"sync_block_s={s:.4f} async_block_s={a:.4f} block_ratio={a / s:.4f} efficiency={eff:.4f} "
              f"async_total_s={total:.4f} sync_total_s={s:.4f} gpu_shaped_async_total_s={ga:.4f} "
              f"gpu_shaped_sync_total_s={gs:.4f} gpu_shaped_ratio={ga / gs:.4f} n={len(plain)} "
              f"n_gpu_shaped={len(gpu_async)} (gpu_shaped_*: emulated device time)", flush=True)
        status = verdict(figures, [Target("block_ratio", "<=", 0.05), Target("efficiency", ">=", 0.98),
                                   Target("async_total_ratio", "<=", 0.5),
                                   Target("gpu_shaped_ratio", "<=", 0.3)])
        Path(run_dir, "status").write_text(str(status))  # the parent's exit status, after torchrun's
    dist.barrier()
    dist.destroy_process_group()


def _thread_cpu() -> dict[str, float]:
    """CPU seconds so far of each thread of this process (``name:tid``) and of each child process
    (``child:name:pid``, all its threads), from /proc; empty elsewhere."""
    tick = os.sysconf("SC_CLK_TCK")

    def stat(path: str) -> tuple[str, float] | None:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                data = f.read()
        except OSError:
            return None
        fields = data[data.rindex(")") + 2:].split()
        return data[data.index("(") + 1:data.rindex(")")], (int(fields[11]) + int(fields[12])) / tick

    out: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        if (got := stat(f"/proc/self/task/{tid}/stat")) is not None:
            out[f"{got[0]}:{tid}"] = got[1]
        try:
            with open(f"/proc/self/task/{tid}/children", encoding="ascii") as f:
                children = f.read().split()
        except OSError:
            children = []
        for pid in children:
            if (got := stat(f"/proc/{pid}/stat")) is not None:
                out[f"child:{got[0]}:{pid}"] = got[1]
    return out


def _idle_s() -> float:
    """Seconds the machine's cores have been idle (all cores summed), from /proc/stat; 0 elsewhere."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
        return (int(fields[4]) + int(fields[5])) / os.sysconf("SC_CLK_TCK")  # idle + iowait
    except (OSError, ValueError, IndexError):
        return 0.0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--controls", type=int, default=0,
                   help="pairs of windows without/with an idle-priority control load "
                        "(CPU only, copying memory)")
    p.add_argument("--gpu-repeats", type=int, default=7,
                   help="triples of GPU-shaped saves (emulated device time): async, sync, none (a control)")
    p.add_argument("--device-share", type=float, default=0.5,
                   help="the share of a GPU-shaped step that is emulated device time (the host idle)")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--run-dir", default=None)
    a = p.parse_args()
    if not 0 <= a.device_share < 1:
        p.error("--device-share must be in [0, 1)")
    if a.worker:
        worker(a.run_dir, a.repeats, a.window, a.controls, a.gpu_repeats, a.device_share)
        return 0
    run_dir = tempfile.mkdtemp(prefix="bench-ckpt-")
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR", PYTHONPATH=str(ROOT))
    try:
        rc = subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              "--nproc-per-node", "2", __file__, "--worker", "--run-dir", run_dir,
                              "--repeats", str(a.repeats), "--window", str(a.window),
                              "--controls", str(a.controls), "--gpu-repeats", str(a.gpu_repeats),
                              "--device-share", str(a.device_share)],
                             env=env, cwd=ROOT)
        status = Path(run_dir, "status")
        return rc or (int(status.read_text()) if status.exists() else 1)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
