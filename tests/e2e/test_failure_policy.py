"""Failure policies with real trainer processes (2 ranks, gloo, NVRx): a rule on an exit code stops
ft_launcher's in-job restarts and the job; a rule on NaN losses stops the job on the second one; stop and
keep freezes the processes for debugging until an operator's Stop releases them."""

import psutil
import pytest

from controlplane.jobs import policy, services
from controlplane.jobs.models import Event, Job, JobStatus
from controlplane.jobs.spec import Drill, JobSpec
from controlplane.launchers.local import LocalLauncher, launch_tag
from controlplane.launchers.services import supervise_all
from tests.helpers import end_job, wait_for
from trainer.policy_rules import parse_rules
from trainer.wire import EventKind

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

EXITS_93 = """\
import os, sys, time
print("step 1", flush=True)
time.sleep(3)
if os.environ.get("RANK") == "1":
    sys.exit(93)  # e.g. a user's "this is not worth restarting" status
time.sleep(120)
"""


def _job(rules, **spec) -> Job:
    base = dict(preset="tiny", steps=400, checkpoint_interval=10, step_timeout_s=20.0, stall_timeout_s=60.0,
                heartbeat_interval_s=0.5, failure_policy=parse_rules(rules))
    base.update(spec)
    return services.create_job(name="policy", spec=JobSpec(**base), created_by=None)


def _status(job: Job) -> str:
    supervise_all()
    job.refresh_from_db()
    return job.status


def _processes(tag: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("UNBROKEN_LAUNCH_TAG") == tag:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def _alive(tag: str) -> list[psutil.Process]:
    return [p for p in _processes(tag) if _status_of(p) not in (psutil.STATUS_ZOMBIE, None)]


def _status_of(p: psutil.Process) -> str | None:
    try:
        return p.status()
    except psutil.NoSuchProcess:
        return None


def _log(job: Job) -> str:
    job.refresh_from_db()
    return LocalLauncher().log_tail(job, max_bytes=8000)


def _cleanup(job: Job) -> None:
    end_job(job)


def _decisions(job: Job) -> list[tuple]:
    return [(e.data["action"], e.data["rule"]) for e in Event.objects.filter(job=job, kind=policy.POLICY_EVENT)]


def test_an_exit_code_rule_stops_in_job_restarts_and_the_job(e2e_settings, celery_beat_thread, tmp_path):
    (tmp_path / "exits.py").write_text(EXITS_93)
    job = _job([{"match": {"exit_code": 93}, "action": "stop"}], entrypoint="exits.py", working_dir=str(tmp_path),
               in_process=False, max_in_job_restarts=5)
    try:
        wait_for(lambda: _status(job) == JobStatus.FAILED, timeout_s=120, what="the job to fail")
        assert "rule 1: exit code 93 → stop the job" in job.status_reason, (job.status_reason, _log(job))
        assert job.attempt == 0  # no job-level restart either
        launcher = [e.data for e in Event.objects.filter(job=job, kind=EventKind.LAUNCHER)]
        # ft_launcher read the same rule and did not restart the worker group
        assert any(d.get("policy_rule") == 1 for d in launcher), launcher
        assert not any("worker group restarted" in d.get("message", "") for d in launcher), launcher
        assert ("stop", 1) in _decisions(job)
        wait_for(lambda: _alive(launch_tag(job)) == [], timeout_s=60, what="its processes to end")
    finally:
        _cleanup(job)


def test_a_nan_loss_rule_stops_the_job_on_the_second_nan(e2e_settings, celery_beat_thread):
    job = _job([{"match": {"class": "nan_loss"}, "action": "stop", "after": 2, "without_progress": False}],
               drills=(Drill(step=12, fault="nan_loss", rank=1), Drill(step=24, fault="nan_loss", rank=0)))
    try:
        wait_for(lambda: _status(job) == JobStatus.FAILED, timeout_s=180, what="the job to fail")
        assert job.status_reason.startswith("failure policy rule 1: nan_loss ×2 → stop the job"), job.status_reason
        assert _decisions(job)[:2] == [("retry_in_process", None), ("stop", 1)], _decisions(job)
        wait_for(lambda: _alive(launch_tag(job)) == [], timeout_s=90, what="its processes to be stopped")
    finally:
        _cleanup(job)


def test_stop_and_keep_freezes_the_processes_until_an_operator_stops_the_job(e2e_settings, celery_beat_thread):
    job = _job([{"match": {"class": "exception"}, "action": "stop_keep"}], steps=100000,
               drills=(Drill(step=12, fault="exception", rank=1),))
    try:
        wait_for(lambda: _status(job) == JobStatus.FAILED, timeout_s=120, what="the job to fail")
        assert "kept for debugging" in job.status_reason
        held = wait_for(lambda: Job.objects.get(pk=job.pk).launcher_state.get("held"), timeout_s=30,
                        what="the launcher to hold the processes")
        assert held.startswith("processes frozen (SIGSTOP)"), held
        frozen = _alive(launch_tag(job))
        assert len(frozen) >= 3 and all(_status_of(p) == psutil.STATUS_STOPPED for p in frozen), \
            [(p.pid, _status_of(p)) for p in frozen]
        assert _status(job) == JobStatus.FAILED  # nothing relaunches a failed job

        services.stop_job(job=Job.objects.get(pk=job.pk), requested_by=None)
        wait_for(lambda: _alive(launch_tag(job)) == [], timeout_s=60, what="the kept processes to be released")
        # The processes go first, then the launcher's record of holding them (one state write later).
        wait_for(lambda: "held" not in Job.objects.get(pk=job.pk).launcher_state, timeout_s=30,
                 what="the launcher to forget the held processes")
    finally:
        _cleanup(job)
