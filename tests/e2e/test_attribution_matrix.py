"""The attribution matrix on the local backend, with real processes (2 ranks, gloo): integration level
(0, 1, 2) x injected failure x the rank it hits (0 and the last). The failure is injected by the script
itself the way a real one happens (``matrix/inject.py``: no fault drill, no fact left for the product),
so the control plane must find the cause from what the layers report. For every cell: exactly one
primary fault, at the injected rank and of its class; every other fault linked to it.

Slow (about a minute a cell on a quiet machine); one cell:

    pytest tests/e2e/test_attribution_matrix.py -m slow -k "level1-sigkill-r1"

``make bench-attribution`` runs the cells several times and reports the figures
(``tests/bench/bench_attribution.py``; it sets ``MATRIX_RESULTS`` to collect one JSON line per run).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from controlplane.jobs import services
from controlplane.jobs.models import Fault, Job, JobStatus
from controlplane.jobs.spec import JobSpec
from controlplane.launchers.local import LocalLauncher
from controlplane.launchers.services import supervise_all
from tests.e2e.matrix.cells import CELL_IDS, CELLS, WORLD
from tests.helpers import end_job
from trainer.wire import FaultClass

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

MATRIX = Path(__file__).resolve().parent / "matrix"
EXPECTED_CLASS = {"sigkill": FaultClass.PROCESS_KILLED, "exception": FaultClass.EXCEPTION,
                  "hang": FaultClass.HANG, "sigkill_save": FaultClass.PROCESS_KILLED,
                  "exit137": FaultClass.PROCESS_KILLED, "import": FaultClass.EXCEPTION}
# Level 0 sees a hang in the printed step alone (a thread beats for the process): the ranks end themselves
# at the stall timeout with their stacks, and the stacks tell the hung rank from the one waiting for it.
# ``make test`` runs one cell per failure, spread over the levels and ranks; MATRIX_FULL=1 (and the
# benchmark) runs every cell.
REPRESENTATIVE = {"level0-sigkill-r1", "level0-hang-r1", "level1-exception-r1", "level1-hang-r1", "level2-sigkill_save-r0",
                  "level0-exit137-r1", "level2-import-r0", "level2-sigkill-r1", "level2-exit137-r1"}
FULL = os.environ.get("MATRIX_FULL") == "1"
STEP = 25  # the injected failure's step (saves every 10: the save-time kill hits step 30's save)


def e2e_data_dir() -> str:
    from django.conf import settings

    return str(settings.DATA_DIR)


def run_cell(tmp_path: Path, level: int, failure: str, rank: int, *, timeout_s: float = 300,
             env: dict[str, str] | None = None, **spec_fields) -> dict:
    """One run of one cell: the job to its end, the attribution followed as the API shows it. Returns the
    figures (see ``check``)."""
    mark = tmp_path / "fired"
    script = "broken.py" if failure == "import" else f"level{level}.py"
    level0_hang = level == 0 and failure == "hang"
    spec = JobSpec(entrypoint=str(MATRIX / script), working_dir=str(tmp_path), steps=60, procs_per_node=WORLD,
                   checkpoint_interval=10, step_timeout_s=15.0 if level == 2 else 5.0,
                   stall_timeout_s=15.0 if level0_hang else 60.0,
                   heartbeat_interval_s=0.5,
                   in_process=level == 2,
                   env={"MATRIX_FAIL": failure, "MATRIX_RANK": str(rank), "MATRIX_STEP": str(STEP),
                        "MATRIX_MARK": str(mark), **(env or {})},
                   **spec_fields)
    job = services.create_job(name=f"matrix level{level} {failure} r{rank}", spec=spec, created_by=None)
    snapshot, changed_at = None, None  # every fault's link: settled when it last changed
    primary, primary_at = None, None  # the primary faults: the attribution, final when it last changed
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            supervise_all()
            job.refresh_from_db()
            now = tuple(Fault.objects.filter(job=job).order_by("id").values_list("id", "primary_id", "link"))
            if now != snapshot:
                snapshot, changed_at = now, time.time()
            top = tuple(f for f in now if f[1] is None)
            if top != primary:
                primary, primary_at = top, time.time()
            if job.status in (JobStatus.SUCCEEDED, JobStatus.FAILED):
                break
            time.sleep(0.1)
    finally:
        end_job(job)
    injected_at = float(mark.read_text().split()[0]) if mark.exists() else None
    if failure == "import":  # nothing fires it: the fault's own time stands in for the injection's
        first = Fault.objects.filter(job=job).order_by("at").values_list("at", flat=True).first()
        injected_at = first.timestamp() if first else None
    # A hang becomes a failure when the job's step timeout says so: the clock starts there, not at the
    # moment the loop stopped (detection is its own figure: make bench-recovery).
    started = injected_at
    if injected_at is not None and failure == "hang":
        started = injected_at + (spec.stall_timeout_s if level0_hang else spec.step_timeout_s)
    if os.environ.get("MATRIX_LOGS"):  # the job's logs, for a second opinion (tests/bench/nvrx_attribution.py)
        logs = Path(e2e_data_dir()) / "jobs" / str(job.pk) / "logs"
        with open(Path(os.environ["MATRIX_LOGS"]) / f"level{level}-{failure}-r{rank}-{job.pk}.log", "w") as out:
            for part in sorted(logs.glob("*.log")):
                out.write(part.read_text(errors="replace"))
    faults = list(Fault.objects.filter(job=job).order_by("at", "id"))
    primaries = [f for f in faults if f.primary_id is None]
    return {
        "cell": f"level{level}-{failure}-r{rank}", "job": job.pk, "status": job.status,
        "status_reason": job.status_reason, "injected": injected_at is not None,
        "primaries": [(f.rank, f.fault_class, f.count) for f in primaries],
        "faults": [(f.pk, f.rank, f.fault_class, f.primary_id, f.link, f.why, (f.message or "")[:200],
                    f"at {f.at:%H:%M:%S.%f} detected {f.detected_at:%H:%M:%S.%f} cycle {f.cycle.key if f.cycle else None}")
                   for f in faults],
        "primary_correct": len(primaries) == 1
        and primaries[0].fault_class == EXPECTED_CLASS[failure]
        and (failure == "import" or primaries[0].rank == rank),
        "extra_faults": max(0, len(primaries) - 1),
        "attribution_s": (max(0.0, primary_at - started) if started is not None and primary_at else None),
        "settled_s": (max(0.0, changed_at - started) if started is not None and changed_at else None),
        "log": LocalLauncher().log_tail(job, max_bytes=3000),
    }


@pytest.mark.parametrize(("level", "failure", "rank"), CELLS, ids=CELL_IDS)
def test_the_primary_fault_names_the_injected_rank_and_class(e2e_settings, celery_beat_thread, tmp_path,
                                                             level, failure, rank):
    if not FULL and f"level{level}-{failure}-r{rank}" not in REPRESENTATIVE:
        pytest.skip("the full matrix runs with MATRIX_FULL=1 (make bench-attribution runs it)")
    out = run_cell(tmp_path, level, failure, rank)
    if os.environ.get("MATRIX_RESULTS"):
        with open(os.environ["MATRIX_RESULTS"], "a") as f:
            f.write(json.dumps({k: v for k, v in out.items() if k != "log"}, default=str) + "\n")
    why = json.dumps({k: out[k] for k in ("status", "status_reason", "primaries", "faults")}, default=str,
                     indent=1) + "\n" + out["log"]
    assert out["injected"], why
    assert out["primary_correct"] and out["extra_faults"] == 0, why
    job = Job.objects.get(pk=out["job"])
    if failure == "import":
        assert job.status == JobStatus.FAILED and "used up" not in job.status_reason, why
        assert len(out["faults"]) == 1 and "ModuleNotFoundError" in out["faults"][0][6], why
    else:
        assert job.status == JobStatus.SUCCEEDED, why


def test_a_torn_checkpoint_at_level1_is_one_folded_fault_whose_summary_names_the_load(
        e2e_settings, celery_beat_thread, tmp_path):
    """Rank 1 is killed while step 30 is being saved; the script's own resume then loads that torn save
    on every restart: one fault for the kill, and one for the load, counted, not one per restart."""
    from controlplane.jobs.evidence import fault_evidence

    out = run_cell(tmp_path, 1, "sigkill_save", 1, env={"MATRIX_NAIVE_RESUME": "1"}, job_restart=False,
                   max_in_job_restarts=3, storm_restarts=3)
    why = json.dumps({k: out[k] for k in ("status", "status_reason", "primaries", "faults")}, default=str,
                     indent=1) + "\n" + out["log"]
    assert out["status"] == JobStatus.FAILED, why
    roots = list(Fault.objects.filter(job_id=out["job"], primary__isnull=True).select_related("cycle"))
    folded = [f for f in roots if f.count >= 2]
    assert len(folded) == 1 and len(roots) <= 2, why
    summary = fault_evidence(folded[0]).summary
    assert summary.startswith("Every restart fails the same way while loading a checkpoint"), summary
    assert "step_30" in summary, summary
