"""A real training job on a real cluster, through the Kubernetes launcher (no database, no Celery).

Runs when KUBECONFIG points to a cluster and UNBROKEN_E2E_IMAGE names a trainer image the cluster can
pull; skipped otherwise. Settings (environment):

- UNBROKEN_E2E_IMAGE      trainer image (required), e.g. 123456789012.dkr.ecr.us-east-1.amazonaws.com/trainer:1
- UNBROKEN_E2E_NAMESPACE  namespace with the checkpoint claim (default: unbroken)
- UNBROKEN_E2E_CLAIM      ReadWriteMany PVC (default: fsx-checkpoints)
- UNBROKEN_E2E_NODES      nodes (default 1); UNBROKEN_E2E_PROCS processes per node (default 1)
- UNBROKEN_E2E_GPUS / UNBROKEN_E2E_EFA per node (default 0 / 0: runs on CPU nodes with gloo)
- UNBROKEN_E2E_NVRX       NVRx version in the image (default 0.4.1)
- UNBROKEN_E2E_INGEST_URL where pods report (default: none reachable; the reporter spools and training goes on)
- UNBROKEN_E2E_TIMEOUT_S  per phase (default 900)

It checks preflight, launch, the pods running and the rendezvous across nodes, success, the log tail,
a job-level restart (stop + attempt 1 resumes from the checkpoints in the run dir), and that stop
leaves nothing behind.
"""

from __future__ import annotations

import os
import secrets
import time

import pytest

from controlplane.jobs.models import Job, JobStatus
from controlplane.jobs.spec import JobSpec
from controlplane.launchers import manifests
from controlplane.launchers.kubernetes import KubernetesLauncher

pytestmark = [
    pytest.mark.k8s_e2e,
    pytest.mark.skipif(not (os.environ.get("KUBECONFIG") and os.environ.get("UNBROKEN_E2E_IMAGE")),
                       reason="set KUBECONFIG (a real cluster) and UNBROKEN_E2E_IMAGE (a trainer image) to run"),
]
ENV = os.environ.get
TIMEOUT_S = float(ENV("UNBROKEN_E2E_TIMEOUT_S", "900"))


def make_job(attempt: int = 0, job_id: int | None = None, steps: int = 40) -> Job:
    spec = JobSpec.from_dict({
        "backend": "kubernetes", "nodes": int(ENV("UNBROKEN_E2E_NODES", "1")),
        "procs_per_node": int(ENV("UNBROKEN_E2E_PROCS", "1")), "preset": "tiny", "steps": steps,
        "checkpoint_interval": 10, "kubernetes": {
            "namespace": ENV("UNBROKEN_E2E_NAMESPACE", "unbroken"), "image": ENV("UNBROKEN_E2E_IMAGE"),
            "checkpoint_claim": ENV("UNBROKEN_E2E_CLAIM", "fsx-checkpoints"),
            "gpus_per_node": int(ENV("UNBROKEN_E2E_GPUS", "0")), "efa_per_node": int(ENV("UNBROKEN_E2E_EFA", "0")),
            "nvrx_version": ENV("UNBROKEN_E2E_NVRX", "0.4.1"), "image_pull_policy": "Always"},
    })
    return Job(pk=job_id, name="k8s-e2e", spec=spec.to_dict(), backend="kubernetes", attempt=attempt)


def wait_for(launcher: KubernetesLauncher, job: Job, states: set[str]) -> str:
    deadline = time.monotonic() + TIMEOUT_S
    seen = []
    while time.monotonic() < deadline:
        result = launcher.poll(job)
        if not seen or seen[-1] != (result.state, result.reason):
            seen.append((result.state, result.reason))
            print(f"poll: {result.state} {result.reason} {[f.fault_class for f in result.faults]}")
        if result.state in states:
            return result.state
        if result.state in ("failed", "lost"):
            pytest.fail(f"job {result.state}: {result.reason}\n--- log tail ---\n{launcher.log_tail(job)}")
        time.sleep(3)
    pytest.fail(f"no {states} within {TIMEOUT_S:.0f} s; states seen: {seen}\n{launcher.log_tail(job)}")


@pytest.fixture()
def launcher():
    return KubernetesLauncher(kubeconfig=ENV("KUBECONFIG"), ingest_url=ENV("UNBROKEN_E2E_INGEST_URL", "http://127.0.0.1:9"))


@pytest.fixture()
def job_id(launcher):
    job_id = 900_000 + secrets.randbelow(99_999)  # far above real ids: never collides with a real job's names
    yield job_id
    launcher.stop(make_job(job_id=job_id), grace_s=5)


def test_it_runs_a_job_restarts_it_and_cleans_up(launcher, job_id):
    job = make_job(job_id=job_id, steps=200)
    assert launcher.preflight(job) == []
    state = launcher.launch(job, token="ubk_e2e_" + secrets.token_urlsafe(16))
    assert state["name"] == f"unbroken-{job_id}"
    assert wait_for(launcher, job, {"running", "succeeded"})

    # Job-level restart, the control plane's way: stop with the token kept, attempt 1 reuses it.
    job.status = JobStatus.RECOVERING
    launcher.stop(job, grace_s=10)
    job = make_job(job_id=job_id, attempt=1, steps=200)
    launcher.launch(job, token=None)
    assert wait_for(launcher, job, {"succeeded"}) == "succeeded"
    tail = launcher.log_tail(job)
    print(tail)
    assert tail  # attempt 1 ran (and resumed from /checkpoints/unbroken-<id> if attempt 0 saved any)

    launcher.stop(job, grace_s=5)
    names = manifests.names_for(job.job_spec, job_id)
    assert launcher.poll(job).state == "lost"  # nothing left: the Job, its pods, Service and Secret are gone
    assert launcher._pods(names, job_id, None) == []
