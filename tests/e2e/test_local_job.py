"""A job launched through the control plane runs real NVRx/FSDP processes on this machine; its
heartbeats and events land, drills show up as faults and restart cycles with their phases, and
operator commands (job-level restart, stop) work without leaving processes behind."""

import os

import psutil
import pytest

from controlplane.jobs import services
from controlplane.jobs.models import Checkpoint, Command, Fault, Job, JobStatus, Rank, RestartCycle
from controlplane.jobs.spec import Drill, JobSpec
from controlplane.launchers.local import launch_tag
from controlplane.launchers.services import supervise_all
from tests.helpers import wait_for
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


def _tagged_processes(tag: str) -> list[int]:
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.pid != os.getpid() and p.environ().get("UNBROKEN_LAUNCH_TAG") == tag:
                out.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def test_it_runs_a_drill_job_to_success_with_faults_and_cycles(e2e_settings, celery_beat_thread):
    job = _job(drills=(Drill(step=25, fault="exception", rank=1), Drill(step=55, fault="sigkill", rank=0)))
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
        assert _tagged_processes(first_tag) == []
        job.refresh_from_db()
        assert job.attempt == 1
        assert cycle.resumed_from_step is not None and cycle.resumed_from_step >= 10
        restart = Command.objects.get(job=job, kind="restart")
        assert (restart.status, restart.detail) == ("done", "relaunched as attempt 1")

        services.stop_job(job=job, requested_by=None, grace_s=1.0)
        wait_for(lambda: _status(job) == JobStatus.STOPPED, timeout_s=90, what="the job to stop")
        wait_for(lambda: _tagged_processes(launch_tag(job)) == [], timeout_s=30, what="its processes to exit")
    finally:
        _cleanup(job)


def _log(job: Job) -> str:
    from controlplane.launchers.local import LocalLauncher

    job.refresh_from_db()
    return LocalLauncher().log_tail(job, max_bytes=6000)


def _cleanup(job: Job) -> None:
    from controlplane.launchers.local import LocalLauncher

    job.refresh_from_db()
    LocalLauncher().stop(job, grace_s=2.0)
