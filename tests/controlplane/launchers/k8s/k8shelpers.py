"""Test helpers for the Kubernetes launcher: ``Cluster`` wraps a fresh loopback API server and plays the
controllers the fake does not run (Job controller, scheduler, kubelet, node lifecycle); spec/job factories."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from kubernetes import client

from controlplane.jobs.models import Job
from controlplane.jobs.spec import JobSpec
from controlplane.launchers import manifests

from kfake import KFakeThread  # the type of Cluster.srv

NS = "train"
INGEST_URL = "http://unbroken-web.unbroken.svc.cluster.local:8000"


def k8s_spec(**overrides: Any) -> JobSpec:
    k8s = {"namespace": NS, "image": "registry.example/trainer:1", "nvrx_version": "0.4.1",
           **overrides.pop("kubernetes", {})}
    return JobSpec.from_dict({"backend": "kubernetes", "nodes": 2, "procs_per_node": 8, "kubernetes": k8s,
                              **overrides})


def make_job(pk: int = 7, attempt: int = 0, **spec_overrides: Any) -> Job:
    """An unsaved Job: enough for the launcher, which reads only pk, attempt, status and spec."""
    return Job(pk=pk, name=f"job-{pk}", spec=k8s_spec(**spec_overrides).to_dict(), backend="kubernetes",
               attempt=attempt)


class Cluster:
    def __init__(self, srv: KFakeThread):
        self.srv = srv
        self.emu = srv.emulator
        cfg = client.Configuration()
        cfg.host = srv.url
        self.api = client.ApiClient(cfg)
        self.core = client.CoreV1Api(self.api)
        self.batch = client.BatchV1Api(self.api)

    # -- what exists --------------------------------------------------------------------------------------

    def objects(self, plural: str, ns: str | None = NS) -> dict[str, dict]:
        return {name: obj.raw for (res, n, name), obj in self.emu.objects.items()
                if res.plural == plural and n == ns and not obj.deleted}

    def get(self, plural: str, name: str, ns: str = NS) -> dict | None:
        return self.objects(plural, ns).get(name)

    def requests(self, method: str = "", path_part: str = "") -> list[tuple]:
        return [r for r in self.emu.log_requests if r[0].endswith(method.upper()) and path_part in r[1]]

    # -- what the cluster has ------------------------------------------------------------------------------

    def add_namespace(self, ns: str = NS) -> None:
        self.emu.namespaces.add(ns)

    def add_pvc(self, name: str = "fsx-checkpoints", *, modes=("ReadWriteMany",), phase: str = "Bound",
                storage_class: str | None = "fsx-sc", ns: str = NS) -> None:
        body = {"metadata": {"name": name}, "spec": {"accessModes": list(modes),
                                                      "resources": {"requests": {"storage": "1200Gi"}}}}
        if storage_class:
            body["spec"]["storageClassName"] = storage_class
        self.core.create_namespaced_persistent_volume_claim(ns, body)
        self.core.patch_namespaced_persistent_volume_claim_status(name, ns, {"status": {"phase": phase}})

    def add_node(self, name: str, *, gpus: int = 8, efa: int = 32, labels: dict | None = None) -> None:
        self.core.create_node({"metadata": {"name": name, "labels": labels or {"node-type": "p5"}}})
        alloc = {"cpu": "190", "memory": "2000Gi", "nvidia.com/gpu": str(gpus), "vpc.amazonaws.com/efa": str(efa)}
        self.core.patch_node_status(name, {"status": {"allocatable": alloc, "capacity": alloc}})

    def ready(self, *, nodes: int = 2, gpus: int = 8) -> None:
        self.add_namespace()
        self.add_pvc()
        for i in range(nodes):
            self.add_node(f"ip-10-0-0-{i}", gpus=gpus)

    # -- playing the Job controller, scheduler and kubelet ----------------------------------------------

    def start_pods(self, job_name: str = "unbroken-7", ns: str = NS) -> list[str]:
        """What the Job controller does for an unsuspended Indexed Job: one pod per index."""
        job = self.get("jobs", job_name, ns)
        assert job is not None, f"no Job {job_name}"
        assert job["spec"].get("suspend") is False, "the launcher must unsuspend the Job"
        names = []
        for i in range(job["spec"]["completions"]):
            tmpl = json.loads(json.dumps(job["spec"]["template"]))
            name = f"{job_name}-{i}-{uuid.uuid4().hex[:5]}"
            meta = {**tmpl["metadata"], "name": name, "namespace": ns,
                    "annotations": {manifests.COMPLETION_INDEX: str(i)},
                    "ownerReferences": [manifests.owner_reference(job)]}
            meta["labels"] = {**meta["labels"], manifests.COMPLETION_INDEX: str(i), "job-name": job_name}
            spec = {**tmpl["spec"], "hostname": f"{job_name}-{i}"}
            self.core.create_namespaced_pod(ns, {"metadata": meta, "spec": spec})
            names.append(name)
        return names

    def pod_names(self, job_id: int = 7) -> list[str]:
        pods = [p for p in self.objects("pods").values() if p["metadata"]["labels"].get(manifests.L_JOB_ID) == str(job_id)]
        return [p["metadata"]["name"] for p in sorted(pods, key=lambda p: int(p["metadata"]["annotations"][manifests.COMPLETION_INDEX]))]

    def set_status(self, pod: str, status: dict, ns: str = NS) -> None:
        self.core.patch_namespaced_pod_status(pod, ns, {"status": status})

    def schedule(self, pod: str, node: str) -> None:
        self.core.patch_namespaced_pod(pod, NS, {"spec": {"nodeName": node}})

    def run(self, pod: str, node: str = "ip-10-0-0-0") -> None:
        self.schedule(pod, node)
        self.set_status(pod, {"phase": "Running", "containerStatuses": [
            {"name": "trainer", "image": "registry.example/trainer:1", "imageID": "", "ready": True, "restartCount": 0,
             "state": {"running": {"startedAt": _now()}}}]})

    def terminate(self, pod: str, *, exit_code: int, reason: str = "Error", message: str = "") -> None:
        phase = "Succeeded" if exit_code == 0 else "Failed"
        self.set_status(pod, {"phase": phase, "containerStatuses": [
            {"name": "trainer", "image": "registry.example/trainer:1", "imageID": "", "ready": False, "restartCount": 0,
             "state": {"terminated": {"exitCode": exit_code, "reason": reason, "message": message,
                                      "startedAt": _now(), "finishedAt": _now()}}}]})

    def unschedulable(self, pod: str, message: str = "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.") -> None:
        self.set_status(pod, {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message,
             "lastTransitionTime": _now()}]})

    def image_pull_backoff(self, pod: str) -> None:
        self.set_status(pod, {"phase": "Pending", "containerStatuses": [
            {"name": "trainer", "image": "registry.example/trainer:1", "imageID": "", "ready": False, "restartCount": 0,
             "state": {"waiting": {"reason": "ImagePullBackOff",
                                   "message": 'Back-off pulling image "registry.example/trainer:1"'}}}]})

    def evict(self, pod: str) -> None:
        self.set_status(pod, {"phase": "Failed", "reason": "Evicted",
                              "message": "The node was low on resource: memory."})

    def lose_node(self, pod: str) -> None:
        """Node lifecycle controller: the node went unreachable; the taint manager evicts the pod."""
        self.set_status(pod, {"phase": "Failed", "conditions": [
            {"type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager",
             "message": "Taint manager: deleting due to NoExecute taint", "lastTransitionTime": _now()}]})

    def fail_job(self, job_name: str = "unbroken-7", reason: str = "BackoffLimitExceeded") -> None:
        self.batch.patch_namespaced_job_status(job_name, NS, {"status": {"conditions": [
            {"type": "Failed", "status": "True", "reason": reason, "message": "Job has reached the specified backoff limit",
             "lastTransitionTime": _now()}]}})

    def complete_job(self, job_name: str = "unbroken-7") -> None:
        self.batch.patch_namespaced_job_status(job_name, NS, {"status": {"conditions": [
            {"type": "Complete", "status": "True", "lastTransitionTime": _now()}]}})

    def warn(self, involved: str, reason: str, message: str, kind: str = "Pod") -> None:
        self.core.create_namespaced_event(NS, {
            "metadata": {"name": f"{involved}.{uuid.uuid4().hex[:8]}"}, "type": "Warning", "reason": reason,
            "message": message, "involvedObject": {"kind": kind, "name": involved, "namespace": NS},
            "lastTimestamp": _now()})


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
