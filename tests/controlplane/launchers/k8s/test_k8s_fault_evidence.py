"""A Kubernetes fault's proof on the fault page and in the API, from the fake API server: the container's
termination reason and message (as the kubelet keeps them in the pod's status) and the log lines of the
fault's pod around its time (``read_namespaced_pod_log``)."""

import base64
import time

import pytest
from django.urls import reverse

from controlplane.jobs.models import Fault
from controlplane.launchers import services
from trainer.wire import FaultClass

from test_k8s_supervise import launched

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("use_fake_cluster")]

MESSAGE = """Traceback (most recent call last):
  File "/app/train.py", line 88, in step
    out = model(batch)
RuntimeError: CUDA error: an illegal memory access was encountered HF_TOKEN=hf_abcdefghijklmnopqrstuvwxyz"""


def _line(t: float, who: str, text: str) -> str:
    return f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(t))},{int(t * 1000) % 1000:03d} {who} {text}"


def _viewer(client):
    from django.contrib.auth.models import User

    User.objects.create_user("viewer", password="correct horse battery")
    client.login(username="viewer", password="correct horse battery")
    return client


def test_the_fault_page_shows_the_termination_reason_message_and_the_pods_log(cluster, client):
    job, (p0, p1) = launched(cluster, max_job_restarts=0)
    now = time.time()
    cluster.emu.logs[("train", p1)] = "\n".join([
        _line(now - 60, "r9", "INFO long before: not shown"),
        _line(now - 2, "r9", "INFO step 41 loss 2.1"),
        _line(now - 1, "launcher", "INFO worker group FAILED in round 0: rank 9: exit 1"),
    ]) + "\n"
    cluster.terminate(p1, exit_code=1, reason="Error", message=MESSAGE)
    services.supervise_job(job=job)
    f = Fault.objects.get(job=job)
    assert f.fault_class == FaultClass.PROCESS_KILLED and f.rank is None

    body = _viewer(client).get(reverse("dashboard:fault", args=[job.pk, f.pk])).content.decode()
    assert 'data-testid="fault-reason">terminated: Error<' in body
    assert "RuntimeError: CUDA error: an illegal memory access" in body
    assert "hf_abcdefghijklmnopqrstuvwxyz" not in body  # redacted
    assert "exit code 1" in body
    assert "step 41 loss 2.1" in body and "worker group FAILED" in body and "long before" not in body

    auth = {"HTTP_AUTHORIZATION": "Basic " + base64.b64encode(b"viewer:correct horse battery").decode()}
    ev = client.get(f"/api/v1/jobs/{job.pk}/faults/{f.pk}", **auth).json()["evidence"]
    assert ev["reason"] == "Error" and ev["exit_code"] == 1
    assert ev["termination_message"].startswith("Traceback (most recent call last):")
    assert ev["exception_type"] == "RuntimeError"
    assert any("step 41 loss 2.1" in line for line in ev["log"])


def test_an_oom_kill_shows_its_reason_and_says_why_a_gone_pod_has_no_log(cluster, client):
    job, (p0, p1) = launched(cluster, max_job_restarts=1)
    cluster.terminate(p1, exit_code=137, reason="OOMKilled")
    services.supervise_job(job=job)  # relaunched: attempt 0's pods are deleted
    f = Fault.objects.get(job=job)
    body = _viewer(client).get(reverse("dashboard:fault", args=[job.pk, f.pk])).content.decode()
    assert "terminated: OOMKilled" in body and "was killed for running out of memory (OOMKilled)" in body
    assert "node rank 1&#x27;s pod of attempt 1 has no log" in body


def test_a_secret_in_the_termination_message_is_never_stored(cluster):
    job, (p0, p1) = launched(cluster, max_job_restarts=0)
    cluster.terminate(p1, exit_code=1, message=MESSAGE)
    services.supervise_job(job=job)
    job.refresh_from_db()
    assert "hf_abcdefghijklmnopqrstuvwxyz" not in Fault.objects.get(job=job).message
    assert "hf_abcdefghijklmnopqrstuvwxyz" not in job.status_reason and "CUDA error" in job.status_reason
