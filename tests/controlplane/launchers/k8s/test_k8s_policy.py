"""Failure policies on the Kubernetes backend, against the fake API server: a written rule on a pod's
termination reason or exit code stops the job (its pods deleted), stops and keeps it (pods kept until Stop),
or restarts the whole job; without a rule the launcher does what it always did."""

import pytest

from controlplane.jobs import policy
from controlplane.jobs import services as job_services
from controlplane.jobs.models import Command, Event, Fault, Job, JobStatus
from controlplane.launchers import services, tasks
from trainer.wire import FaultClass

from k8shelpers import NS
from test_k8s_supervise import create_job, launched

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("use_fake_cluster")]


def _decision(job: Job) -> dict:
    return Event.objects.filter(job=job, kind=policy.POLICY_EVENT).order_by("-id").first().data


def test_an_oomkilled_rule_stops_the_job_for_good_and_deletes_its_pods(cluster):
    job, (p0, p1) = launched(cluster, max_job_restarts=2,
                             failure_policy=[{"match": {"reason": "OOMKilled"}, "action": "stop"}])
    cluster.terminate(p1, exit_code=137, reason="OOMKilled")
    assert services.supervise_job(job=job) == "failed"
    job.refresh_from_db()
    assert (job.status, job.attempt) == (JobStatus.FAILED, 0)  # not relaunched
    assert job.status_reason.startswith("failure policy rule 1: OOMKilled → stop the job")
    assert (_decision(job)["action"], _decision(job)["rule"]) == ("stop", 1)
    assert Fault.objects.get(job=job).fault_class == FaultClass.OOM_KILLED
    stop = Command.objects.get(job=job, kind="stop")
    tasks.stop(job.pk, stop.pk)  # what the nudge's task does
    for plural in ("jobs", "pods", "services", "secrets"):
        assert cluster.objects(plural, NS) == {}, plural


def test_without_a_rule_an_oom_kill_still_restarts_the_whole_job(cluster):
    job, (p0, p1) = launched(cluster, max_job_restarts=2)
    cluster.terminate(p1, exit_code=137, reason="OOMKilled")
    services.supervise_job(job=job)
    job.refresh_from_db()
    assert (job.status, job.attempt) == (JobStatus.RECOVERING, 1)
    assert (_decision(job)["action"], _decision(job)["rule"]) == ("restart_job", None)
    assert _decision(job)["why"] == "default: job_restart on, 2 left"


def test_an_exit_code_rule_never_restarts(cluster):
    job, (p0, _) = launched(cluster, failure_policy=[{"match": {"exit_code": 93}, "action": "stop"}])
    cluster.terminate(p0, exit_code=93, message="CUDA error: an illegal memory access was encountered")
    services.supervise_job(job=job)
    job.refresh_from_db()
    assert (job.status, job.attempt) == (JobStatus.FAILED, 0)
    assert "exit code 93" in job.status_reason


def test_stop_and_keep_keeps_the_pods_until_an_operator_stops_the_job(cluster):
    job, (p0, p1) = launched(cluster, failure_policy=[{"match": {"class": "oom_killed"}, "action": "stop_keep"}])
    cluster.terminate(p1, exit_code=137, reason="OOMKilled")
    services.supervise_job(job=job)
    job.refresh_from_db()
    assert job.status == JobStatus.FAILED and "kept for debugging" in job.status_reason
    assert not Command.objects.filter(job=job, kind="stop").exists()
    tasks.hold(job.pk)
    job.refresh_from_db()
    assert job.launcher_state["held"].startswith(f"Job {NS}/unbroken-{job.pk} and its 2 pod(s) kept")
    assert "1 still running" in job.launcher_state["held"]
    assert len(cluster.pod_names(job.pk)) == 2 and cluster.get("jobs", f"unbroken-{job.pk}") is not None
    assert services.supervise_all() == 0  # a failed job is not supervised: nothing relaunches it

    cmd = job_services.stop_job(job=job, requested_by=None)
    tasks.stop(job.pk, cmd.pk)
    job.refresh_from_db()
    assert "held" not in job.launcher_state
    for plural in ("jobs", "pods", "services", "secrets"):
        assert cluster.objects(plural, NS) == {}, plural


def test_a_restart_job_rule_on_a_trainer_fault_relaunches_every_pod(cluster):
    job, _ = launched(cluster, failure_policy=[{"match": {"class": "nan_loss"}, "action": "restart_job"}])
    job.status = JobStatus.RUNNING
    job.save()
    Fault.objects.create(job=job, fault_class=FaultClass.NAN_LOSS, rank=3, detected_by="trainer",
                         at=job.status_changed_at, source_key="nan-1")
    assert policy.apply_policies() == 1
    cmd = Command.objects.get(job=job, kind="restart", level="job")
    tasks.restart(job.pk, cmd.pk)
    job.refresh_from_db()
    assert (job.attempt, job.status) == (1, JobStatus.RECOVERING)
    k8s_job = cluster.get("jobs", f"unbroken-{job.pk}")
    assert k8s_job["metadata"]["labels"]["unbroken.dev/attempt"] == "1"


def test_an_image_pull_rule_stops_at_once_instead_of_waiting_out_the_pending_timeout(cluster):
    job = create_job(failure_policy=[{"match": {"class": "image_pull"}, "action": "stop"}])
    tasks.launch(job.pk)
    job.refresh_from_db()
    for pod in cluster.start_pods(f"unbroken-{job.pk}"):
        cluster.image_pull_backoff(pod)
    assert services.supervise_job(job=job) == "pending"
    assert policy.apply_policies() == 1
    job.refresh_from_db()
    assert job.status == JobStatus.FAILED and "image_pull → stop the job" in job.status_reason
    tasks.stop(job.pk, Command.objects.get(job=job, kind="stop").pk)
    assert cluster.objects("pods", NS) == {}
