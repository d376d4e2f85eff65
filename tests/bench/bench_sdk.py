"""SDK benchmark: what the SDK's full level costs a training step, and how fast an unmodified
(Level-0) script's killed rank reaches the control plane.

- Step overhead: ``tests/bench/sdk_workload.py`` (the FSDP2 model of ``trainer/examples/fsdp_level2.py``,
  2 ranks, gloo on CPU) runs the same steps as a plain loop under ``torchrun`` (saving its own sync DCP
  checkpoints every 20 steps, as a plain script does) and through the SDK
  under the product's launcher (``trainer.launch --entrypoint``: ft_launcher, the NVRx Wrapper,
  reporter on, async DCP checkpoints at the interval), alternating, ``--runs`` each (each pair back
  to back, which one goes first alternating between pairs, so a drifting machine biases neither). R = median step
  time with the SDK / without, checkpoint steps excluded (a save started; with async saves also the
  next step, whose wait for the staging copy is that save's blocking time); P = p99 of the time spent
  inside the SDK's per-step calls (``ctx.step``, ``maybe_save`` on non-saving steps,
  ``wait_for_staging``), checkpoint steps excluded.
- Level-0 detection: ``trainer/examples/plain_fsdp.py`` unmodified under the launcher with a SIGKILL
  drill on rank 1; D = the fault event's arrival at the ingest sink - the kill. Both launches report
  every 1 s, the job spec's default heartbeat interval. The sink is a loopback
  HTTP server standing in for the ingest endpoint (the control plane's own ingest adds milliseconds).

    python tests/bench/bench_sdk.py [--runs 3] [--steps 300]

- In-run A/B: one more SDK run whose loop skips the per-step calls in every other window of 25 steps,
  so the same processes and threads run throughout; its two medians separate the calls' share of R
  from the rest of the product's process tree (launcher, NVRx monitors, reporter, saver threads).

Last line: sdk_step_overhead_p99_ms=<P> sdk_overhead_ratio=<R> level0_fault_detect_s=<D>
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.trainer.conftest import Receiver, child_env, launch  # noqa: E402
from trainer.ports import free_port_block  # noqa: E402

WORKLOAD = ROOT / "tests" / "bench" / "sdk_workload.py"
SKIP_WARMUP = 5  # the first steps (allocator, first collectives) are not steady state


def _read(out: Path) -> tuple[list[float], list[float]]:
    steps, sdk = [], []
    for f in sorted(out.glob("rank*.json")):
        d = json.loads(f.read_text())
        saved = d["saved"]
        for i, (s, k) in enumerate(zip(d["step_s"], d["sdk_s"], strict=True)):
            # A checkpoint step: a save started in it, or (async) the next one, whose wait_for_staging is
            # that save's blocking time (booked as checkpoint blocking in goodput).
            if i < SKIP_WARMUP or saved[i] or (i > 0 and saved[i - 1] and d.get("async")):
                continue
            steps.append(s)
            sdk.append(k)
    return steps, sdk


def run_plain(steps: int) -> list[float]:
    out = Path(tempfile.mkdtemp(prefix="bench-sdk-plain-"))
    port = free_port_block()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", str(WORKLOAD), "--plain",
           "--steps", str(steps), "--out", str(out)]
    for attempt in (1, 2):
        r = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
        if r.returncode == 0:
            return _read(out)[0]
        # Seen once in ~20 runs: a plain torchrun rank aborted (SIGABRT) in gloo. Say so, run it again.
        (out / f"failed-{attempt}.log").write_text(r.stdout + r.stderr)
        print(f"  note: the plain torchrun run failed (rc {r.returncode}, log {out}/failed-{attempt}.log)"
              + ("; running it again" if attempt == 1 else ""), flush=True)
    raise SystemExit(f"plain run failed twice:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")


def run_sdk(steps: int, recv: Receiver) -> tuple[list[float], list[float]]:
    run_dir = Path(tempfile.mkdtemp(prefix="bench-sdk-"))
    out = run_dir / "times"
    r = launch(run_dir, trainer_flags=["--in-process", "--steps", str(steps), "--ckpt-interval", "20"],
               report_url=recv.url, timeout_s=600, entrypoint=str(WORKLOAD), report_interval=1.0,
               user_args=["--steps", str(steps), "--out", str(out)])
    if r.rc != 0:
        raise SystemExit(f"SDK run failed (rc {r.rc}):\n{r.log[-3000:]}")
    return _read(out)


def run_ab(steps: int, recv: Receiver, window: int = 25) -> tuple[float, float]:
    """One SDK run whose loop skips the SDK's per-step calls in every other window of ``window`` steps:
    the same processes and threads run throughout, so the two medians compare the calls alone."""
    run_dir = Path(tempfile.mkdtemp(prefix="bench-sdk-ab-"))
    out = run_dir / "times"
    r = launch(run_dir, trainer_flags=["--in-process", "--steps", str(steps), "--ckpt-interval", "20"],
               report_url=recv.url, timeout_s=600, entrypoint=str(WORKLOAD), report_interval=1.0,
               user_args=["--steps", str(steps), "--out", str(out), "--alternate", str(window)])
    if r.rc != 0:
        raise SystemExit(f"SDK A/B run failed (rc {r.rc}):\n{r.log[-3000:]}")
    on, off = [], []
    for f in sorted(out.glob("rank*.json")):
        d = json.loads(f.read_text())
        for i, (s, saved, calls) in enumerate(zip(d["step_s"], d["saved"], d["calls"], strict=True)):
            if i < SKIP_WARMUP or saved or (i > 0 and d["saved"][i - 1]) or i % window < 2:
                continue  # warm-up, checkpoint steps, and each window's first steps (the switch)
            (on if calls else off).append(s)
    return statistics.median(on), statistics.median(off)


def level0_detect(recv: Receiver) -> float:
    run_dir = Path(tempfile.mkdtemp(prefix="bench-sdk-l0-"))
    r = launch(run_dir, trainer_flags=["--no-in-process", "--steps", "400", "--drill", "150:sigkill:1"],
               report_url=recv.url, timeout_s=600, report_interval=1.0,
               entrypoint=str(ROOT / "trainer" / "examples" / "plain_fsdp.py"),
               user_args=["--steps", "400", "--ckpt-dir", str(run_dir / "ckpt")])
    if r.rc != 0:
        raise SystemExit(f"Level-0 run failed (rc {r.rc}):\n{r.log[-3000:]}")
    time.sleep(0.5)
    with recv.lock:
        batches = list(recv.batches)
    killed_at = next(e["at"] for b in batches for e in b.get("events", [])
                     if e["kind"] == "cycle" and e["data"]["mark"] == "fault_at")
    arrived = next(b["_received_at"] for b in batches for e in b.get("events", [])
                   if e["kind"] == "fault" and e["data"]["fault"] == "process_killed")
    return arrived - killed_at


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=300)
    a = p.parse_args()
    ratios, sdk_all, detects = [], [], []
    for i in range(a.runs):
        recv = Receiver().start()
        try:
            # The pair's order alternates (plain first, then the SDK first): this VM's step time drifts by
            # minutes, and a fixed order would book the drift between a pair's two runs as SDK overhead.
            if i % 2 == 0:
                plain = run_plain(a.steps)
                sdk_steps, sdk_calls = run_sdk(a.steps, recv)
            else:
                sdk_steps, sdk_calls = run_sdk(a.steps, recv)
                plain = run_plain(a.steps)
            detects.append(level0_detect(recv))
        finally:
            recv.stop()
        ratio = statistics.median(sdk_steps) / statistics.median(plain)  # a pair run back to back
        ratios.append(ratio)
        sdk_all += sdk_calls
        print(f"run {i + 1}: plain median step {statistics.median(plain) * 1e3:.2f} ms, SDK "
              f"{statistics.median(sdk_steps) * 1e3:.2f} ms (ratio {ratio:.3f}); SDK calls p50 "
              f"{pct(sdk_calls, 0.5) * 1e3:.3f} ms p99 {pct(sdk_calls, 0.99) * 1e3:.3f} ms; "
              f"Level-0 kill -> fault {detects[-1]:.2f} s", flush=True)
    print(f"pair ratios {', '.join(f'{r:.3f}' for r in sorted(ratios))} (this VM's step time drifts by up to "
          f"~20% between minutes: see the spread)", flush=True)
    recv = Receiver().start()
    try:
        on, off = run_ab(2 * a.steps, recv)
    finally:
        recv.stop()
    print(f"in one SDK run, windows of 25 steps with and without the per-step calls: {on * 1e3:.2f} / "
          f"{off * 1e3:.2f} ms (ratio {on / off:.3f}): the rest of R is the product's processes and threads",
          flush=True)
    print(f"sdk_step_overhead_p99_ms={pct(sdk_all, 0.99) * 1e3:.3f} sdk_overhead_ratio={statistics.median(ratios):.3f} "
          f"level0_fault_detect_s={statistics.median(detects):.2f}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
