"""Report benchmark: the resilience report's goodput projection checked against a measured run.

Real components on this machine: a fresh SQLite control plane (``manage.py runserver``, ingest only),
two real training jobs of the tiny preset (``python -m trainer.launch``, 2 ranks, gloo on CPU) reporting
to it with their own tokens, the report built from what it stored.

1. The drill plan: the default plan of ``jobs.drill_plan`` (every class Level 2 supports, on the first
   and the last rank), as a "Check resilience" run would lay it out. Its report gives the model's
   inputs: the median step time, the save cost per checkpoint, the mean recovery per fault, start-up
   and shutdown.
2. The measured run: the same spec with ``--faults`` faults of mixed classes at random steps (a Poisson
   process conditioned on the count: uniform steps, seeded), ``--steps-per-fault`` steps apart on
   average. Its goodput is the product's (``Job.goodput``, as the job page shows it).
3. ``predicted_goodput``: ``projection.run_goodput`` fed only the drill report's figures and the run's
   length and fault count; ``error_pts`` = predicted - measured, in percentage points.
4. ``report_s``: building the report and its HTML file for a job of 100 cycles (synthetic rows).

    python tests/bench/bench_report.py [--faults 10] [--steps-per-fault 60] [--seed 7] [--repeats 1]

Last line exactly:
    classes=<C> drills=<D> predicted_goodput=<P> measured_goodput=<M> error_pts=<E> report_s=<S>
Exit status 1 when a target is missed: every supported class covered, |error_pts| <= 5, report_s <= 5.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
DATA = Path(tempfile.mkdtemp(prefix="bench-report-"))
os.environ["UNBROKEN_DATA_DIR"] = str(DATA)
os.environ.setdefault("UNBROKEN_SECRET_KEY_FILE", str(ROOT / "var" / "secret_key"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

import django  # noqa: E402
import msgspec  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402
from django.utils import timezone  # noqa: E402

from controlplane.jobs import drill_plan, projection, services  # noqa: E402
from controlplane.jobs.models import Job  # noqa: E402
from controlplane.jobs.resilience_report import build_report  # noqa: E402
from controlplane.jobs.spec import DEMO_SPEC, Drill  # noqa: E402
from tests.trainer.conftest import launch_spec  # noqa: E402
from trainer.ports import free_port  # noqa: E402

MIXED = ("exception", "hang", "sigkill", "nan_loss", "hang_collective")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def start_server() -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "manage.py", "runserver", "--noreload", f"127.0.0.1:{port}"],
                            cwd=ROOT, env=dict(os.environ), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(120):
        try:
            urllib.request.urlopen(f"{url}/api/v1/openapi.json", timeout=1)  # loopback
            return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("runserver did not come up")


def run_job(name: str, spec, url: str) -> Job:
    """Create the job, run it to the end reporting to ``url``, mark it finished."""
    # Each drill is a restart of its own: room for all of them (and two more) in-job.
    spec = msgspec.structs.replace(spec, max_in_job_restarts=len(spec.drills) + 2, heartbeat_interval_s=1.0)
    job = services.create_job(name=name, spec=spec, created_by=None, launch=False)
    token = job.issue_token()
    job.save(update_fields=["token_hash"])
    Job.objects.filter(pk=job.pk).update(status="running", started_at=timezone.now())
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench-report-{job.pk}-", dir=DATA))
    run = launch_spec(run_dir, spec, report_url=url, job_id=str(job.pk), token=token, timeout_s=1800)
    (run_dir / "launch.log").write_text(run.log)
    time.sleep(3)  # the reporters' last batches
    job.refresh_from_db()
    services.set_status(job, "succeeded" if run.rc == 0 else "failed", f"launcher exited {run.rc}")
    if run.rc != 0:
        log(f"{name}: launcher exited {run.rc}; log in {run_dir / 'launch.log'}")
    job.refresh_from_db()
    return job


def poisson_drills(n: int, *, steps_per_fault: int, interval: int, world: int, seed: int):
    rng = random.Random(seed)
    steps = n * steps_per_fault + 2 * interval
    at = sorted(rng.sample(range(interval + 1, steps - interval), n))
    return tuple(Drill(step=s, fault=rng.choice(MIXED), rank=rng.choice((0, world - 1))) for s in at), steps


def report_seconds() -> float:
    from controlplane.dashboard.report import standalone_html
    from tests.controlplane.api.test_report import _hundred_cycles
    from tests.controlplane.dashboard.factories import make_job

    now = timezone.now()
    job = make_job(now=now, age_s=7300)
    _hundred_cycles(job, now)
    t0 = time.perf_counter()
    standalone_html(build_report(job, now=now))
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--faults", type=int, default=10)
    ap.add_argument("--steps-per-fault", type=int, default=60)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=1,
                    help="the drill plan's repeats (each class 2x per repeat)")
    ap.add_argument("--plan-faults", default="", help="a shorter plan: these classes only (comma-separated)")
    a = ap.parse_args()
    call_command("migrate", verbosity=0)
    server, url = start_server()
    try:
        base = DEMO_SPEC
        faults = tuple(a.plan_faults.split(",")) if a.plan_faults else drill_plan.supported_faults(base)
        plan = drill_plan.Plan(faults=faults, repeats=a.repeats)
        spec = drill_plan.plan_spec(base, plan)
        log(f"drill plan: {len(spec.drills)} drills over {spec.steps} steps")
        drill_job = run_job("drill plan", spec, url)
        r = build_report(drill_job)
        covered = len(r.supported) - len(r.missing)
        cycles = len(r.recovery.cycles)
        log(f"drill report: classes {covered}/{len(r.supported)} (missing {r.missing}), {cycles} cycles, "
            f"recovery p50 {r.recovery.recovery.p50_s} p95 {r.recovery.recovery.p95_s}, "
            f"reload share {r.recovery.reload_share}, goodput {r.goodput['goodput']:.3f}")
        if r.at_scale is None:
            raise SystemExit("the drill run reported no step time")
        s = r.at_scale
        rec = s.scenarios[0].recovery_s
        fixed = r.goodput["startup_s"] + r.goodput["idle_s"]
        drills, steps = poisson_drills(a.faults, steps_per_fault=a.steps_per_fault,
                                       interval=base.checkpoint_interval, world=base.world_size, seed=a.seed)
        measured_spec = msgspec.structs.replace(base, drills=drills, steps=steps)
        log(f"measured run: {len(drills)} faults over {steps} steps: "
            + ", ".join(f"{d.step}:{d.fault}:{d.rank}" for d in drills))
        run = run_job("measured run", measured_spec, url)
        measured = run.goodput()["goodput"]
        work = steps * s.step_time_s
        period = s.interval_s + s.save_cost_s
        rate = len(drills) / (work * period / s.interval_s)
        predicted = projection.run_goodput(work_s=work, startup_s=fixed, interval_s=s.interval_s,
                                           save_cost_s=s.save_cost_s, rate_per_s=rate, recovery_s=rec)
        log(f"model inputs (drill report only): step {s.step_time_s:.3f} s, save cost {s.save_cost_s:.3f} s, "
            f"recovery {rec:.2f} s, start-up + shutdown {fixed:.1f} s; measured run: "
            f"{len(build_report(run).recovery.cycles)} cycles, wall {run.goodput()['wall_s']:.0f} s")
        report_s = report_seconds()
    finally:
        server.terminate()
        server.wait(10)
    error = 100 * (predicted - measured)
    ok = covered == len(r.supported) and abs(error) <= 5 and report_s <= 5
    print(f"classes={covered} drills={len(spec.drills)} predicted_goodput={predicted:.3f} "
          f"measured_goodput={measured:.3f} error_pts={error:.1f} report_s={report_s:.2f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
