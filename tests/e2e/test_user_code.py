"""The user's own training code, run through the control plane with real processes (2 ranks, gloo):
an unmodified FSDP2 script (Level 0), the same script with the SDK's few lines (Level 1), the same
training as an SDK entrypoint (Level 2), and code that cannot start."""

import time
from pathlib import Path

import pytest

from controlplane.jobs import services
from controlplane.jobs.models import (
    Checkpoint,
    Command,
    CommandStatus,
    Event,
    Fault,
    Job,
    JobStatus,
    Rank,
    RestartCycle,
)
from controlplane.jobs.spec import Drill, JobSpec
from controlplane.launchers.local import LocalLauncher, launch_tag
from controlplane.launchers.services import supervise_all
from tests.helpers import end_job, tagged_processes, wait_for
from trainer.wire import CheckpointState, EventKind, FaultClass, Layer

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

EXAMPLES = Path(__file__).resolve().parents[2] / "trainer" / "examples"


def _job(tmp_path: Path, entrypoint: str, *, args: tuple[str, ...] = (), **spec) -> Job:
    base = dict(entrypoint=entrypoint, args=args, working_dir=str(tmp_path), steps=200, step_timeout_s=5.0,
                stall_timeout_s=60.0, heartbeat_interval_s=0.5, in_process=False)
    base.update(spec)
    return services.create_job(name="own code", spec=JobSpec(**base), created_by=None)


def _finish(job: Job, timeout_s: float = 240) -> Job:
    def done() -> bool:
        supervise_all()
        job.refresh_from_db()
        return job.status in (JobStatus.SUCCEEDED, JobStatus.FAILED)

    wait_for(done, timeout_s=timeout_s, what=f"job {job.pk} to finish")
    return job


def _log(job: Job) -> str:
    job.refresh_from_db()
    return LocalLauncher().log_tail(job, max_bytes=8000)


def _cleanup(job: Job) -> None:
    end_job(job)


def _faults(job: Job) -> list:
    return list(Fault.objects.filter(job=job).values("id", "fault_class", "rank", "detected_by", "primary_id", "link",
                                                     "cycle__layer", "message"))


def test_it_supervises_an_unmodified_script_through_a_kill_and_an_exception(e2e_settings, celery_beat_thread,
                                                                             tmp_path):
    job = _job(tmp_path, str(EXAMPLES / "plain_fsdp.py"), args=("--steps", "200"),
               drills=(Drill(step=40, fault="sigkill", rank=1), Drill(step=120, fault="exception", rank=0)))
    try:
        _finish(job)
        assert job.status == JobStatus.SUCCEEDED, (job.status_reason, _log(job))
        killed = Fault.objects.filter(job=job, fault_class=FaultClass.PROCESS_KILLED, cycle__isnull=False).first()
        assert killed is not None and killed.rank == 1 and killed.cycle.layer == Layer.IN_JOB, _faults(job)
        exc = Fault.objects.filter(job=job, fault_class=FaultClass.EXCEPTION, cycle__isnull=False).first()
        assert exc is not None and exc.rank == 0, _faults(job)
        # The rank's own traceback, not a launcher summary.
        assert "DrillError" in exc.message and "Traceback (most recent call last)" in exc.message, exc.message
        for cycle in (killed.cycle, exc.cycle):
            cycle.refresh_from_db()
            assert None not in (cycle.fault_at, cycle.detected_at, cycle.restarted_at, cycle.first_step_at), \
                cycle.__dict__
            assert 0 < cycle.recovery_s < 60
        levels = {e.data["level"] for e in Event.objects.filter(job=job, kind=EventKind.INTEGRATION)}
        assert levels == {0}
        hello = Event.objects.filter(job=job, kind=EventKind.INTEGRATION).first().data
        assert hello["torch"].startswith("2.") and hello["nvrx"] != "not installed"
        wait_for(lambda: Rank.objects.filter(job=job, last_step=200).exists(), timeout_s=30,
                 what="progress parsed from the script's output")
        assert "FINAL_LOSS" in (Path(e2e_settings.DATA_DIR) / "jobs" / str(job.pk) / "logs" / "rank0.log").read_text()
    finally:
        _cleanup(job)


def test_an_operator_stop_ends_an_unmodified_script_at_once_as_stopped(e2e_settings, celery_beat_thread, tmp_path):
    """A Level-0 script cannot see a stop command: the launcher stops it without the trainer's grace."""
    job = _job(tmp_path, str(EXAMPLES / "plain_fsdp.py"), args=("--steps", "100000"), steps=100000)
    try:
        wait_for(lambda: Rank.objects.filter(job=job, last_step__gte=10).count() == 2, timeout_s=120,
                 what="both ranks to print steps")
        assert services.stop_grace_s(job) == 0.0
        tag = launch_tag(Job.objects.get(pk=job.pk))
        t0 = time.monotonic()
        cmd = services.stop_job(job=job, requested_by=None)
        wait_for(lambda: not tagged_processes(tag), timeout_s=60, what="the job's processes to exit")
        took = time.monotonic() - t0
        print(f"stop -> no process left: {took:.2f} s")
        job.refresh_from_db()
        assert job.status == JobStatus.STOPPED, job.status_reason
        # SIGTERM ends an unmodified script at once; 10 s is the launcher's SIGTERM -> SIGKILL grace.
        assert took < 10.0, took
        for _ in range(4):  # supervision passes after the exit must not take it for a failure
            supervise_all()
        job.refresh_from_db()
        assert job.status == JobStatus.STOPPED, job.status_reason
        assert not Fault.objects.filter(job=job).exists(), _faults(job)
        wait_for(lambda: Command.objects.get(pk=cmd.pk).status == CommandStatus.DONE, timeout_s=30,
                 what="the stop command to be carried out")
    finally:
        _cleanup(job)


def test_it_detects_a_hung_level1_loop_from_its_heartbeats_and_restarts_it(e2e_settings, celery_beat_thread,
                                                                            tmp_path):
    job = _job(tmp_path, str(EXAMPLES / "fsdp_level1.py"), args=("--steps", "150"), steps=150,
               drills=(Drill(step=50, fault="hang", rank=1),))
    try:
        _finish(job)
        assert job.status == JobStatus.SUCCEEDED, (job.status_reason, _log(job))
        # The hung rank's fault is the failure's primary; the peer that waited for it (rank 0, in a
        # collective), if reported, is its consequence.
        hang = Fault.objects.filter(job=job, fault_class=FaultClass.HANG, cycle__isnull=False,
                                    primary__isnull=True).first()
        assert hang is not None and hang.rank == 1, _faults(job)
        assert not Fault.objects.filter(job=job, primary__isnull=True).exclude(pk=hang.pk).exists(), _faults(job)
        assert hang.cycle.layer == Layer.IN_JOB
        # No in-process layer to take the hung rank's stack: its faulthandler wrote it before ft_launcher
        # ended the rank, and the launcher attached it to the fault.
        assert "Stacks of rank 1's threads when its heartbeats stopped" in hang.message, hang.message
        assert 'File "' in hang.message.split("heartbeats stopped", 1)[1], hang.message
        cycle = RestartCycle.objects.get(pk=hang.cycle_id)
        assert cycle.first_step_at is not None
        # ft_launcher saw the loop's heartbeats stop: detected within the step timeout (+ its check interval).
        assert 4.0 <= (cycle.detected_at - cycle.fault_at).total_seconds() < 15.0, cycle.__dict__
        assert {e.data["level"] for e in Event.objects.filter(job=job, kind=EventKind.INTEGRATION)} == {0, 1}
        # With Redis, rank rows follow the heartbeat store on the flush (every few seconds).
        wait_for(lambda: Rank.objects.filter(job=job, last_step=150).count() == 2, timeout_s=30,
                 what="both ranks' rows at the last step")
    finally:
        _cleanup(job)


def _clean_loss(script: Path, steps: int) -> float:
    """The same script under plain torchrun (the SDK does nothing there): the loss to come back to."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script), "--steps", str(steps)], capture_output=True, text=True, timeout=180,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    line = next(x for x in out.stdout.splitlines() if x.startswith("FINAL_LOSS"))
    return float(line.split()[1])


@pytest.mark.parametrize("example, steps, every", [("fsdp_level2.py", 150, 20), ("llama_level2.py", 60, 10)])
def test_it_recovers_a_level2_entrypoint_by_every_layer_to_the_clean_runs_loss(e2e_settings, celery_beat_thread,
                                                                                tmp_path, example, steps, every):
    script = EXAMPLES / example
    clean = _clean_loss(script, steps)
    drills = (Drill(step=steps // 5, fault="exception", rank=1), Drill(step=steps // 2, fault="sigkill", rank=0),
              Drill(step=steps * 3 // 4, fault="nan_loss", rank=0))
    job = _job(tmp_path, str(script), args=("--steps", str(steps)), steps=steps, in_process=True,
               step_timeout_s=20.0, checkpoint_interval=every, drills=drills)
    try:
        _finish(job)
        assert job.status == JobStatus.SUCCEEDED, (job.status_reason, _log(job))
        final = [x for x in _log(job).splitlines() if "FINAL_LOSS" in x]
        assert final and float(final[-1].split("FINAL_LOSS", 1)[1].split()[0]) == pytest.approx(clean, rel=1e-6)
        got = [(f.fault_class, f.cycle.layer, f.rank) for f in
               Fault.objects.filter(job=job, cycle__isnull=False).select_related("cycle").order_by("at")]
        assert got == [(FaultClass.EXCEPTION, Layer.IN_PROCESS, 1), (FaultClass.PROCESS_KILLED, Layer.IN_JOB, 0),
                       (FaultClass.NAN_LOSS, Layer.IN_PROCESS, 0)], got
        # Every cycle that recovered has all its marks. One the Wrapper opened on a peer's SIGKILL, before
        # ft_launcher restarted the group, has no fault of its own: it is closed as escalated (a race
        # that load decides).
        for c in RestartCycle.objects.filter(job=job):
            marks = (c.fault_at, c.detected_at, c.restarted_at, c.checkpoint_loaded_at, c.first_step_at)
            assert None not in marks or (c.escalated_to and c.first_step_at), c.__dict__
        assert Checkpoint.objects.filter(job=job, state=CheckpointState.DURABLE).count() >= 5
        assert max(e.data["level"] for e in Event.objects.filter(job=job, kind=EventKind.INTEGRATION)) == 2
    finally:
        _cleanup(job)


@pytest.mark.parametrize("source, expect", [
    ("import not_a_module_anywhere\n", "ModuleNotFoundError"),
    ("def broken(:\n    pass\n", "does not compile"),
])
def test_it_fails_code_that_cannot_start_once_with_its_traceback(e2e_settings, celery_beat_thread, tmp_path,
                                                                   source, expect):
    (tmp_path / "train.py").write_text(source)
    job = _job(tmp_path, "train.py")
    try:
        _finish(job, timeout_s=120)
        assert job.status == JobStatus.FAILED, job.status_reason
        assert "failed before training started" in job.status_reason
        assert job.attempt == 0  # no job-level restart
        faults = Fault.objects.filter(job=job, fault_class=FaultClass.EXCEPTION)
        assert faults.count() == 1, _faults(job)
        assert expect in faults.get().message
        assert not RestartCycle.objects.filter(job=job).exists()  # and no in-job rounds
    finally:
        _cleanup(job)
