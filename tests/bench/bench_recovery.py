"""Recovery benchmark: fault -> first completed step after the restart, by fault class and layer.

Real launches (`python -m trainer.launch`, 2 ranks, tiny preset, gloo on CPU). Each run schedules
N drills of one fault (steps 12, 22, 32, ...; checkpoints every 5 steps), so one run yields N
recoveries; the time of each is first_step_at (latest rank) - fault_at of its cycle, from the events
the trainer and launcher report to a local sink. A job-level restart (new processes + checkpoint
reload, as the control plane does with --attempt) is timed from the launch command to its first
step. The reporter's added time per step is its p99 call time for one heartbeat + one event.

    python tests/bench/bench_recovery.py [--n 5]

Last line: in_process_s=<X> in_job_s=<Y> job_s=<Z> hang_s=<W>  (medians)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.trainer.conftest import Receiver, launch  # noqa: E402

SOFT = 3.0
BASE = ["--ckpt-interval", "5", "--soft-timeout", str(SOFT), "--hard-timeout", "8"]


def recoveries(events: list[dict]) -> list[float]:
    by_cycle: dict[str, dict[str, list[float]]] = {}
    for e in events:
        if e["kind"] == "cycle":
            by_cycle.setdefault(e["data"]["cycle"], {}).setdefault(e["data"]["mark"], []).append(e["at"])
    out = []
    for marks in by_cycle.values():
        if "fault_at" in marks and "first_step_at" in marks:
            out.append(max(marks["first_step_at"]) - min(marks["fault_at"]))
    return out


def layers_of(events: list[dict]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for e in events:
        if e["kind"] == "cycle" and e["data"]["mark"] == "first_step_at":
            out.setdefault(e["data"]["cycle"], set()).add(e["data"]["layer"])
    return out


def run_drills(fault: str, n: int, *, in_process: bool = True) -> list[float]:
    steps = 10 * n + 8
    flags = [*BASE, "--steps", str(steps), *[f for i in range(n) for f in ("--drill", f"{10 * i + 12}:{fault}:1")]]
    if not in_process:
        flags.append("--no-in-process")
    recv = Receiver().start()
    try:
        run_dir = Path(tempfile.mkdtemp(prefix=f"bench-{fault}-"))
        run = launch(run_dir, trainer_flags=flags, report_url=recv.url, max_restarts=n + 1, timeout_s=600)
        (run_dir / "launch.log").write_text(run.log)  # kept for post-mortems of slow recoveries
        time.sleep(0.5)
        if run.rc != 0:
            print(run.log[-3000:], file=sys.stderr)
            raise SystemExit(f"{fault}: run failed (rc {run.rc})")
        slow = [c for c, marks in layers_of(recv.events()).items() if marks != {"in_process"}]
        if in_process and fault != "sigkill" and slow:
            print(f"  note: {fault}: cycles {slow} escalated past the in-process layer (log: {run_dir})",
                  flush=True)
        return recoveries(recv.events())
    finally:
        recv.stop()


def run_job_restarts(n: int) -> list[float]:
    run_dir = Path(tempfile.mkdtemp(prefix="bench-job-"))
    first = launch(run_dir, trainer_flags=[*BASE, "--steps", "10"], in_job=False)
    assert first.rc == 0, first.log[-2000:]
    out = []
    for attempt in range(1, n + 1):
        recv = Receiver().start()
        try:
            t0 = time.time()
            run = launch(run_dir, trainer_flags=[*BASE, "--steps", str(10 + attempt)], in_job=False,
                         attempt=attempt, report_url=recv.url)
            assert run.rc == 0, run.log[-2000:]
            time.sleep(0.3)
            firsts = [e["at"] for e in recv.events("cycle") if e["data"]["cycle"] == f"job{attempt}"
                      and e["data"]["mark"] == "first_step_at"]
            out.append(max(firsts) - t0)
        finally:
            recv.stop()
    return out


def reporter_p99_ms(n: int = 20000) -> float:
    from trainer.reporter import HttpReporter
    from trainer.wire import EventKind

    recv = Receiver().start()
    rep = HttpReporter(url=recv.url, job_id="1", token="t", source="rank:0", rank=0,
                       spool_dir=tempfile.mkdtemp(prefix="bench-spool-"), interval_s=0.1)
    times = []
    try:
        for i in range(n):
            t = time.perf_counter()
            rep.heartbeat(step=i, phase="train", loss=1.0, step_time_s=0.1, tokens_per_s=5000.0)
            rep.event(EventKind.CYCLE, {"cycle": "x", "mark": "first_step_at", "step": i})
            times.append(time.perf_counter() - t)
            if i % 100 == 0:
                time.sleep(0.001)  # let the sender thread run, as between real steps
    finally:
        rep.close()
        recv.stop()
    times.sort()
    return times[int(0.99 * len(times))] * 1e3


def fmt(xs: list[float]) -> str:
    return f"median {statistics.median(xs):.2f} s  (n={len(xs)}: {', '.join(f'{x:.2f}' for x in sorted(xs))})"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=5)
    n = p.parse_args().n
    results: dict[str, list[float]] = {}
    for fault in ("exception", "nan_loss", "hang", "hang_collective"):
        results[f"in_process {fault}"] = run_drills(fault, n)
        print(f"in_process  {fault:16s} {fmt(results[f'in_process {fault}'])}", flush=True)
    results["in_job sigkill"] = run_drills("sigkill", n)
    print(f"in_job      {'sigkill':16s} {fmt(results['in_job sigkill'])}", flush=True)
    results["in_job exception"] = run_drills("exception", n, in_process=False)
    print(f"in_job      {'exception':16s} {fmt(results['in_job exception'])}  (--no-in-process)", flush=True)
    results["job"] = run_job_restarts(n)
    print(f"job         {'new processes':16s} {fmt(results['job'])}  (launch -> first step after reload)",
          flush=True)
    p99 = reporter_p99_ms()
    print(f"reporter p99 added time per step: {p99:.4f} ms (heartbeat + event)", flush=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"in_process_s={med['in_process exception']:.2f} in_job_s={med['in_job sigkill']:.2f} "
          f"job_s={med['job']:.2f} hang_s={med['in_process hang']:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
