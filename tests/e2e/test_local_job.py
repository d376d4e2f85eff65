"""A job launched through the control plane runs real NVRx/FSDP processes on this machine; its
heartbeats and events land, drills show up as faults and restart cycles with their phases, and
operator commands (job-level restart, stop) work without leaving processes behind."""

import pytest

from controlplane.jobs import services
from controlplane.jobs.models import Checkpoint, Command, Event, Fault, Job, JobStatus, Rank, RestartCycle
from controlplane.jobs.spec import Drill, JobSpec
from controlplane.jobs.versions import runtime_versions
from controlplane.launchers.local import launch_tag
from controlplane.launchers.services import supervise_all
from tests.helpers import end_job, tagged_processes, wait_for
from trainer import nvrx_compat
from trainer.wire import CheckpointState, FaultClass, Layer

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def _job(**spec) -> Job:
    base = dict(preset="tiny", steps=80, checkpoint_interval=10, step_timeout_s=20.0, stall_timeout_s=60.0,
                heartbeat_interval_s=0.5)
    base.update(spec)
    return services.create_job(name="e2e", spec=JobSpec(**base), created_by=None)


def _status(job: Job) -> str:
    supervise_all()
    job.refresh_from_db()
    return job.status


@pytest.mark.parametrize("node_agent", [False, True], ids=["direct", "node-agent"])
def test_it_runs_a_drill_job_to_success_with_faults_and_cycles(e2e_settings, celery_beat_thread, node_agent):
    """The same faults, layers and phases whether the ranks report directly or through the node agent."""
    job = _job(drills=(Drill(step=25, fault="exception", rank=1), Drill(step=55, fault="sigkill", rank=0)),
               node_agent=node_agent)
    try:
        wait_for(lambda: _status(job) in (JobStatus.SUCCEEDED, JobStatus.FAILED), timeout_s=240,
                 what="the job to finish")
        assert job.status == JobStatus.SUCCEEDED, (job.status_reason, _log(job))

        # With Redis, rank rows follow the heartbeat store on the watchdog's flush (every few seconds).
        wait_for(lambda: list(Rank.objects.filter(job=job).order_by("rank").values_list("rank", "last_step"))
                 == [(0, 80), (1, 80)], timeout_s=30, what="both ranks' rows at the last step")

        exc = Fault.objects.get(job=job, fault_class=FaultClass.EXCEPTION)
        assert exc.rank == 1 and exc.cycle is not None
        assert exc.cycle.layer == Layer.IN_PROCESS
        killed = Fault.objects.filter(job=job, fault_class=FaultClass.PROCESS_KILLED, cycle__isnull=False).first()
        assert killed is not None, list(Fault.objects.filter(job=job).values("fault_class", "detected_by", "message"))
        assert killed.cycle.layer == Layer.IN_JOB

        for cycle in (exc.cycle, killed.cycle):
            cycle.refresh_from_db()
            assert cycle.fault_at and cycle.first_step_at, cycle.__dict__
            assert cycle.checkpoint_loaded_at is not None
            assert 0 < cycle.recovery_s < 60

        durable = Checkpoint.objects.filter(job=job, state=CheckpointState.DURABLE)
        assert durable.count() >= 3
        assert all(c.blocking_s is not None and c.write_s is not None for c in durable)
        sources = set(Event.objects.filter(job=job).values_list("source", flat=True))
        assert any(s.startswith("agent:") for s in sources) == node_agent, sources
    finally:
        _cleanup(job)


def _final_loss(job: Job) -> float | None:
    for line in _log(job).splitlines():
        if "FINAL_LOSS" in line:
            return float(line.split("FINAL_LOSS", 1)[1].split()[0])
    return None


def _run_to_success(job: Job) -> None:
    wait_for(lambda: _status(job) in (JobStatus.SUCCEEDED, JobStatus.FAILED), timeout_s=300,
             what=f"job {job.pk} to finish")
    assert job.status == JobStatus.SUCCEEDED, (job.status_reason, _log(job))


@pytest.mark.nvrx
def test_a_drill_of_every_fault_class_recovers_by_its_layer_to_the_clean_runs_loss(e2e_settings,
                                                                                   celery_beat_thread):
    """The issue's "done when": all layers on, a drill schedule of every fault class; the job ends with
    the clean run's final loss and the control plane holds each fault, its layer and its phases."""
    clean = _job(steps=70)
    try:
        _run_to_success(clean)
        clean_loss = _final_loss(clean)
        assert clean_loss is not None, _log(clean)
    finally:
        _cleanup(clean)
    expected = {  # drill -> (fault class, layer)
        "exception": (FaultClass.EXCEPTION, Layer.IN_PROCESS),
        "nan_loss": (FaultClass.NAN_LOSS, Layer.IN_PROCESS),
        "hang": (FaultClass.HANG, Layer.IN_PROCESS),
        "hang_collective": (FaultClass.HANG, Layer.IN_PROCESS),
        "sigkill": (FaultClass.PROCESS_KILLED, Layer.IN_JOB),
    }
    drills = tuple(Drill(step=15 + 10 * i, fault=f, rank=i % 2) for i, f in enumerate(expected))
    job = _job(steps=70, drills=drills)
    try:
        _run_to_success(job)
        assert _final_loss(job) == pytest.approx(clean_loss, rel=1e-5)
        # The launched trainer ran this session's NVRx (make test runs this test with each release).
        assert {v["nvrx"] for v in runtime_versions(job)} == {nvrx_compat.version_str()}
        faults = list(Fault.objects.filter(job=job, cycle__isnull=False).select_related("cycle").order_by("at"))
        got = [(f.fault_class, f.cycle.layer, f.rank) for f in faults]
        assert got == [(*expected[d.fault], d.rank) for d in drills], got
        for f in faults:
            c = f.cycle
            assert None not in (c.fault_at, c.detected_at, c.aborted_at, c.restarted_at, c.checkpoint_loaded_at,
                                c.first_step_at), c.__dict__
            assert c.fault_at <= c.detected_at <= c.first_step_at
            assert 0 < c.recovery_s < 60
        assert not Fault.objects.filter(job=job, fault_class=FaultClass.HEARTBEAT_LOST).exists()
    finally:
        _cleanup(job)


def test_it_restarts_the_whole_job_and_stops_without_leftovers(e2e_settings, celery_beat_thread):
    job = _job(steps=100000, drills=())
    try:
        wait_for(lambda: Rank.objects.filter(job=job, last_step__gte=12).count() == 2, timeout_s=120,
                 what="both ranks to train")
        first_tag = launch_tag(Job.objects.get(pk=job.pk))

        services.restart_job(job=job, level=Layer.JOB, requested_by=None)
        cycle = wait_for(lambda: RestartCycle.objects.filter(job=job, layer=Layer.JOB,
                                                             first_step_at__isnull=False).first(),
                         timeout_s=120, what="the job-level restart to reach its first step")
        assert cycle.aborted_at and cycle.restarted_at and cycle.checkpoint_loaded_at
        assert tagged_processes(first_tag) == []
        job.refresh_from_db()
        assert job.attempt == 1
        assert cycle.resumed_from_step is not None and cycle.resumed_from_step >= 10
        restart = Command.objects.get(job=job, kind="restart")
        assert (restart.status, restart.detail) == ("done", "relaunched as attempt 1")

        services.stop_job(job=job, requested_by=None, grace_s=1.0)
        wait_for(lambda: _status(job) == JobStatus.STOPPED, timeout_s=90, what="the job to stop")
        wait_for(lambda: tagged_processes(launch_tag(job)) == [], timeout_s=30, what="its processes to exit")
    finally:
        _cleanup(job)


def _log(job: Job) -> str:
    from controlplane.launchers.local import LocalLauncher

    job.refresh_from_db()
    return LocalLauncher().log_tail(job, max_bytes=6000)


def _cleanup(job: Job) -> None:
    end_job(job)
