"""The lead's launcher workflows and Celery tasks driving the Kubernetes launcher against the fake cluster:
job states, faults and job-level restarts that result from what the pods do."""

import base64
from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.jobs import services as job_services
from controlplane.jobs import supervision
from controlplane.jobs.models import Command, Fault, Job, JobStatus, RestartCycle
from controlplane.launchers import services, tasks
from controlplane.launchers.base import TransientLaunchError
from trainer.wire import FaultClass

from k8shelpers import NS, k8s_spec

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("use_fake_cluster")]


def create_job(**spec) -> Job:
    return Job.objects.create(name="k8s", spec=k8s_spec(**spec).to_dict(), backend="kubernetes",
                              status=JobStatus.LAUNCHING)


def launched(cluster, **spec) -> tuple[Job, list[str]]:
    job = create_job(**spec)
    tasks.launch(job.pk)
    job.refresh_from_db()
    pods = cluster.start_pods(f"unbroken-{job.pk}")
    for i, pod in enumerate(pods):
        cluster.run(pod, f"ip-10-0-0-{i}")
    return job, pods


def secret_token(cluster, job) -> str:
    return base64.b64decode(cluster.get("secrets", f"unbroken-{job.pk}-token")["data"]["token"]).decode()


def test_it_launches_with_a_token_whose_hash_the_job_keeps(cluster):
    job, _ = launched(cluster)
    assert job.launcher_state["name"] == f"unbroken-{job.pk}" and job.launcher_state["attempt"] == 0
    assert job.token_matches(secret_token(cluster, job))
    assert services.supervise_job(job=job) == "running"


def test_it_restarts_the_whole_job_after_an_oom_kill_and_records_the_fault_once(cluster):
    job, (p0, p1) = launched(cluster, max_job_restarts=2)
    cluster.terminate(p1, exit_code=137, reason="OOMKilled")
    assert services.supervise_job(job=job) == "failed"
    job.refresh_from_db()
    assert (job.attempt, job.status) == (1, JobStatus.RECOVERING)
    fault = Fault.objects.get(job=job)
    assert (fault.fault_class, fault.detected_by, fault.node) == (FaultClass.OOM_KILLED, "launcher", "ip-10-0-0-1")
    assert RestartCycle.objects.get(job=job).key.endswith("1")
    k8s_job = cluster.get("jobs", f"unbroken-{job.pk}")
    assert k8s_job["metadata"]["labels"]["unbroken.dev/attempt"] == "1"
    assert cluster.pod_names(job.pk) == []  # attempt 0's pods are gone
    assert job.token_matches(secret_token(cluster, job))  # the one token survived the restart
    # The new attempt comes up; polling again records nothing twice.
    for i, pod in enumerate(cluster.start_pods(f"unbroken-{job.pk}")):
        cluster.run(pod, f"ip-10-0-0-{i}")
    assert services.supervise_job(job=job) == "running"
    assert Fault.objects.filter(job=job).count() == 1


def test_it_fails_the_job_when_job_level_restarts_are_used_up(cluster):
    job, (p0, _) = launched(cluster, max_job_restarts=0)
    cluster.lose_node(p0)
    services.supervise_job(job=job)
    job.refresh_from_db()
    assert job.status == JobStatus.FAILED
    assert "node lost" in job.status_reason
    assert Fault.objects.get(job=job).fault_class == FaultClass.NODE_LOST


def test_it_marks_the_job_succeeded_when_every_pod_finished(cluster):
    job, pods = launched(cluster)
    for pod in pods:
        cluster.terminate(pod, exit_code=0, reason="Completed")
    services.supervise_job(job=job)
    job.refresh_from_db()
    assert job.status == JobStatus.SUCCEEDED


def test_it_stops_the_job_and_leaves_nothing_in_the_cluster(cluster):
    job, _ = launched(cluster)
    tasks.stop(job.pk, None)
    job.refresh_from_db()
    assert job.status == JobStatus.STOPPED
    for plural in ("jobs", "pods", "services", "secrets"):
        assert cluster.objects(plural, NS) == {}, plural


def test_it_records_unschedulable_pods_without_failing_the_job(cluster):
    job = create_job()
    tasks.launch(job.pk)
    job.refresh_from_db()
    for pod in cluster.start_pods(f"unbroken-{job.pk}"):
        cluster.unschedulable(pod)
    assert services.supervise_job(job=job) == "pending"
    job.refresh_from_db()
    assert job.is_active
    assert set(Fault.objects.filter(job=job).values_list("fault_class", flat=True)) == {FaultClass.UNSCHEDULABLE}


def test_the_launch_task_retries_transient_api_errors_with_a_cap(cluster):
    job = create_job()
    # Fail after the Secret exists (the unsuspend patch): the retried launch finds and adopts it.
    cluster.emu.fail_next("PATCH", "/jobs/", 503)
    cluster.emu.fail_next("PATCH", "/jobs/", 429)
    result = tasks.launch.apply(args=(job.pk,))  # eager: each retry runs at once, without the backoff wait
    assert result.successful()
    job.refresh_from_db()
    assert job.launcher_state["name"] == f"unbroken-{job.pk}"
    assert job.token_matches(secret_token(cluster, job))
    assert cluster.get("jobs", f"unbroken-{job.pk}")["spec"]["suspend"] is False

    other = create_job()
    for _ in range(tasks.RETRY["max_retries"] + 1):
        cluster.emu.fail_next("PATCH", "/jobs/", 503)
    result = tasks.launch.apply(args=(other.pk,))
    assert result.failed() and isinstance(result.result, TransientLaunchError)


def test_the_launch_task_survives_a_transient_error_before_the_secret_exists(cluster):
    job = create_job()
    cluster.emu.fail_next("POST", "/jobs", 503)
    result = tasks.launch.apply(args=(job.pk,))
    assert result.successful()


def test_it_fails_a_job_whose_pods_cannot_start_for_too_long(cluster):
    from datetime import timedelta

    from django.utils import timezone

    job = create_job()
    tasks.launch(job.pk)
    for pod in cluster.start_pods(f"unbroken-{job.pk}"):
        cluster.unschedulable(pod)
    Job.objects.filter(pk=job.pk).update(status_changed_at=timezone.now() - services.PENDING_TIMEOUT - timedelta(1))
    job.refresh_from_db()
    assert services.supervise_job(job=job) == "pending"
    job.refresh_from_db()
    assert job.status == JobStatus.FAILED
    assert "could not start" in job.status_reason and "Insufficient nvidia.com/gpu" in job.status_reason
    assert cluster.pod_names(job.pk) == []


def test_it_retries_a_job_level_relaunch_that_failed_transiently(cluster):
    from datetime import timedelta

    from django.utils import timezone

    job, (p0, p1) = launched(cluster, max_job_restarts=2)
    cluster.terminate(p1, exit_code=137, reason="OOMKilled")
    cluster.emu.fail_next("POST", "/jobs", 503)
    with pytest.raises(TransientLaunchError):
        services.supervise_job(job=job)
    job.refresh_from_db()
    assert (job.attempt, job.status, job.launcher_state) == (1, JobStatus.RECOVERING, {})

    assert services.retry_stuck_launches() == 0  # too early: waits RELAUNCH_RETRY_AFTER
    later = timezone.now() + services.RELAUNCH_RETRY_AFTER + timedelta(seconds=1)
    assert services.retry_stuck_launches(later) == 1
    job.refresh_from_db()
    assert job.launcher_state["attempt"] == 1
    assert job.token_matches(secret_token(cluster, job))


def test_it_fails_a_launch_that_never_started(cluster):
    from datetime import timedelta

    from django.utils import timezone

    job = create_job()
    services.retry_stuck_launches(timezone.now() + services.LAUNCH_TIMEOUT + timedelta(seconds=1))
    job.refresh_from_db()
    assert job.status == JobStatus.FAILED and "could not start attempt 0" in job.status_reason


def test_a_storm_stop_whose_task_never_ran_is_carried_out_by_the_supervise_pass(
        cluster, django_capture_on_commit_callbacks):
    job, _ = launched(cluster)
    with django_capture_on_commit_callbacks(execute=False):  # the nudge is lost (no broker)
        job_services.set_status(job, JobStatus.FAILED, "restart storm")
        supervision.request_stop(job.pk, reason="restart storm")
    assert cluster.pod_names(job.pk)
    assert services.carry_out_stops() == 0  # not due yet: the task may still come
    later = timezone.now() + services.STOP_BACKSTOP_AFTER + timedelta(seconds=1)
    assert services.carry_out_stops(later) == 1
    assert cluster.pod_names(job.pk) == []
    assert Command.objects.get(job=job).status == "done"
    assert Job.objects.get(pk=job.pk).status == JobStatus.FAILED  # a stop does not rewrite why it failed
    assert services.carry_out_stops(later) == 0


def test_an_operator_stop_is_carried_out_after_the_trainers_grace_even_without_its_task(
        cluster, django_capture_on_commit_callbacks):
    job, _ = launched(cluster)
    Job.objects.filter(pk=job.pk).update(status=JobStatus.RUNNING)
    job.refresh_from_db()
    with django_capture_on_commit_callbacks(execute=False):
        cmd = job_services.stop_job(job=job, requested_by=None)
    soon = timezone.now() + services.STOP_BACKSTOP_AFTER + timedelta(seconds=1)
    assert services.carry_out_stops(soon) == 0  # the trainer still has its grace period
    due = soon + timedelta(seconds=job_services.launcher_port.TRAINER_STOP_GRACE_S)
    assert services.carry_out_stops(due) == 1
    assert cluster.pod_names(job.pk) == []
    assert Job.objects.get(pk=job.pk).status == JobStatus.STOPPED
    assert Command.objects.get(pk=cmd.pk).status == "done"
    assert services.carry_out_stops(due) == 0
