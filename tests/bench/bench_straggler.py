"""Straggler benchmark: how fast a slowed rank is marked, and whether a clean run marks anyone.

Two real launches of the same length (`python -m trainer.launch`, 2 ranks, gloo on CPU, the tiny preset,
the control plane's own trainer flags for a default spec, heartbeats every 1 s as the spec's default):

1. a ``slow_rank`` drill on rank 1 from step ``--slow-step`` (30 %: the rank spends 0.3 of its own work
   per step more, busy);
2. the same job without the drill.

Each batch the ranks send is judged as the control plane judges it when it arrives (``jobs/health.py``'s
``slowdowns`` over every rank's newest ``busy_s``, the spec's default margin). straggler_detect_s is the
time from the drill's first slow step (rank 1's beat at that step) to the first batch after which rank 1
is a straggler; false_positives counts straggler marks of any other rank, of rank 1 before its drill, and
of any rank in the clean run.

evidence_ms: the p99 step time added while a fault's evidence is collected. The rank's evidence is taken
off the main thread (``trainer/evidence.py``: the main thread's stack from the in-process layer's monitor
thread, which is what a hang's evidence is; tracebacks are formatted once, on the fault path), so the cost
to a step is the interference of that collection: one process runs a fixed CPU step (a 256x256 matmul
chain, ~2-5 ms) 1,000 times with no collection, then 1,000 times while another thread takes the main
thread's stack, redacts and JSON-encodes it every 10 ms; evidence_ms = p99(with) - p99(without), the
median of 5 alternating pairs.

    python tests/bench/bench_straggler.py [--runs 3]

Last line: straggler_detect_s=<X> false_positives=<N> evidence_ms=<Y> (medians over the runs)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

import django  # noqa: E402

django.setup()

from controlplane.jobs.spec import Drill, JobSpec  # noqa: E402
from tests.trainer.conftest import spec_flags as trainer_args  # noqa: E402
from tests.trainer.conftest import Receiver, launch  # noqa: E402
from tests.trainer.stragglers import straggler_marks as marks  # noqa: E402


def run_once(steps: int, slow_step: int, fraction: float, *, slow: bool) -> tuple[list[dict], dict]:
    drills = (Drill(step=slow_step, fault="slow_rank", rank=1, fraction=fraction),) if slow else ()
    spec = JobSpec(steps=steps, drills=drills)
    recv = Receiver().start()
    try:
        run_dir = Path(tempfile.mkdtemp(prefix=f"bench-straggler-{'slow' if slow else 'clean'}-"))
        run = launch(run_dir, trainer_flags=trainer_args(spec), report_url=recv.url, timeout_s=600,
                     report_interval=spec.heartbeat_interval_s)
        if run.rc != 0:
            print(run.log[-3000:], file=sys.stderr)
            raise SystemExit(f"{'slow' if slow else 'clean'} run failed (rc {run.rc})")
        return list(recv.batches), {"wall_s": run.wall_s, "margin": spec.straggler_margin_pct}
    finally:
        recv.stop()


def evidence_ms(pairs: int = 5, steps: int = 1000) -> float:
    import json
    import threading
    import time

    import torch

    from trainer.evidence import main_thread_stack

    torch.set_num_threads(1)
    a = torch.randn(256, 256)

    def step() -> None:
        x = a
        for _ in range(4):
            x = torch.tanh(x @ a)

    def p99(collect: bool) -> float:
        stop = threading.Event()

        def collector() -> None:
            while not stop.wait(0.01):
                json.dumps({"stack": main_thread_stack(("secret-token",))})

        t = threading.Thread(target=collector, daemon=True)
        if collect:
            t.start()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        stop.set()
        if collect:
            t.join()
        times.sort()
        return times[int(0.99 * len(times))]

    for _ in range(200):
        step()
    added = [(p99(True) - p99(False)) * 1000 for _ in range(pairs)]
    print(f"evidence: p99 added step time per pair (ms): {', '.join(f'{x:.3f}' for x in added)}")
    return statistics.median(added)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--slow-step", type=int, default=60)
    p.add_argument("--fraction", type=float, default=0.3)
    a = p.parse_args()
    ev_ms = evidence_ms()
    detect, fps = [], []
    for i in range(a.runs):
        batches, info = run_once(a.steps, a.slow_step, a.fraction, slow=True)
        beats = [h for b in batches for h in b.get("heartbeats", [])]
        start = min(h["at"] for h in beats if h["rank"] == 1 and h["step"] >= a.slow_step)
        m = marks(batches, info["margin"])
        hit = [t for t, r in m if r == 1 and t >= start]
        fp = [(t, r) for t, r in m if r != 1 or t < start]
        clean_batches, _ = run_once(a.steps, a.slow_step, a.fraction, slow=False)
        fp += marks(clean_batches, info["margin"])
        d = (hit[0] - start) if hit else float("nan")
        busy = {r: statistics.median(h["busy_s"] for h in beats if h["rank"] == r and h.get("busy_s") is not None
                                     and h["step"] > a.slow_step + 30) for r in (0, 1)}
        print(f"run {i + 1}: detected after {d:.2f} s, false positives {len(fp)} {fp}, busy_s after the drill "
              f"r0={busy[0] * 1000:.1f} ms r1={busy[1] * 1000:.1f} ms (+{(busy[1] / busy[0] - 1) * 100:.0f} %), "
              f"wall {info['wall_s']:.0f} s", flush=True)
        detect.append(d)
        fps.append(len(fp))
    spread = f" (runs: {', '.join(f'{x:.2f}' for x in detect)})"
    print(f"median of {a.runs} runs{spread}")
    print(f"straggler_detect_s={statistics.median(detect):.2f} false_positives={int(statistics.median(fps))} "
          f"evidence_ms={ev_ms:.3f}")


if __name__ == "__main__":
    main()
