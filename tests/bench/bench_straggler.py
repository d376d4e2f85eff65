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

evidence_ms (p99 step time added while a fault's evidence is collected) needs the fault-evidence work of
issue 10, which is not built yet: it prints NA.

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
from controlplane.launchers.command import trainer_args  # noqa: E402
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--slow-step", type=int, default=60)
    p.add_argument("--fraction", type=float, default=0.3)
    a = p.parse_args()
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
          f"evidence_ms=NA")


if __name__ == "__main__":
    main()
