"""The Kubernetes launcher: one attempt = one Indexed Job (or JobSet) + headless Service + token Secret.

The only module that imports ``kubernetes``. Manifests come from ``manifests`` (pure functions); this
module applies them and reads pods and events back; ``pods`` (pure functions) turns what it reads into a
``PollResult``.

Errors: API answers that retrying can fix (429, 5xx, timeouts, a conflict with an object still being
deleted) raise ``TransientLaunchError`` (the Celery task on the ``launch`` queue retries with backoff
and a cap); everything else raises ``LaunchError`` with a message for the user.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import urllib3
from django.conf import settings
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from controlplane.jobs.models import Job, JobStatus
from controlplane.jobs.spec import JobSpec
from controlplane.launchers import manifests
from controlplane.launchers.base import LaunchError, PollResult, TransientLaunchError
from controlplane.launchers.command import nvrx_problems
from controlplane.launchers.pods import needs_events, node_rank, summarize

_pod_node_rank = node_rank  # log_tail's keyword argument shadows the name

log = logging.getLogger(__name__)

TRANSIENT_STATUSES = frozenset({429, 500, 502, 503, 504})
REQUEST_TIMEOUT = (5.0, 30.0)  # connect, read
PREFLIGHT_TIMEOUT = (3.0, 10.0)  # the new-job form waits on these
MERGE_PATCH = "application/merge-patch+json"
JOBSET = ("jobset.x-k8s.io", "v1alpha2", "jobsets")


class KubernetesLauncher:
    name = "kubernetes"

    def __init__(self, *, api_client: client.ApiClient | None = None, kubeconfig: str = "", ingest_url: str = "",
                 delete_wait_s: float = 90.0, sleep: Callable[[float], None] = time.sleep):
        self._api = api_client
        self.kubeconfig = kubeconfig
        self.ingest_url = ingest_url
        self.delete_wait_s = delete_wait_s
        self.sleep = sleep

    @classmethod
    def from_settings(cls) -> KubernetesLauncher:
        return cls(kubeconfig=settings.KUBECONFIG, ingest_url=settings.UNBROKEN_K8S_INGEST_URL)

    # -- API plumbing ---------------------------------------------------------------------------------

    @property
    def api(self) -> client.ApiClient:
        """The API client, from KUBECONFIG when set, else the pod's service account (in-cluster)."""
        if self._api is None:
            try:
                if self.kubeconfig:
                    self._api = config.new_client_from_config(config_file=self.kubeconfig)
                else:
                    cfg = client.Configuration()
                    config.load_incluster_config(client_configuration=cfg)
                    self._api = client.ApiClient(cfg)
            except (ConfigException, OSError) as e:
                where = f"KUBECONFIG={self.kubeconfig}" if self.kubeconfig else "the in-cluster service account"
                raise LaunchError(f"no usable Kubernetes configuration ({where}: {e}); set KUBECONFIG to a "
                                  "kubeconfig file, or run the control plane in a pod with a service account") from None
        return self._api

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, allow: tuple[int, ...] = (),
              timeout: tuple[float, float] = REQUEST_TIMEOUT, text: bool = False, **kwargs: Any) -> Any:
        """Call the API; return the JSON answer (``text``: the body as text), or None when the status is
        in ``allow``."""
        try:
            resp = fn(*args, _preload_content=False, _request_timeout=timeout, **kwargs)
        except ApiException as e:
            if e.status in allow:
                return None
            raise _translate(e, what) from None
        except urllib3.exceptions.HTTPError as e:  # connection refused, timeouts, broken streams
            raise TransientLaunchError(f"{what}: the Kubernetes API server did not answer ({e}); retrying") from None
        except ValueError as e:  # the client's own (pydantic) check of a body, before sending it
            raise LaunchError(f"{what}: the manifest is not valid Kubernetes ({e}); check the kubernetes "
                              "settings of the job (tolerations, node_selector)") from None
        data = resp.data
        if text:
            return data.decode("utf-8", "replace")
        try:
            return json.loads(data) if data else {}
        except ValueError:
            return data.decode("utf-8", "replace")

    def _workload_ops(self, names: manifests.Names) -> dict[str, Callable[..., Any]]:
        ns, name = names.namespace, names.workload
        if names.use_jobset:
            co = client.CustomObjectsApi(self.api)
            return {
                "create": lambda body, **kw: co.create_namespaced_custom_object(*JOBSET[:2], ns, JOBSET[2], body, **kw),
                "read": lambda **kw: co.get_namespaced_custom_object(*JOBSET[:2], ns, JOBSET[2], name, **kw),
                "patch": lambda body, **kw: co.patch_namespaced_custom_object(
                    *JOBSET[:2], ns, JOBSET[2], name, body, _content_type=MERGE_PATCH, **kw),
                "delete": lambda **kw: co.delete_namespaced_custom_object(
                    *JOBSET[:2], ns, JOBSET[2], name, propagation_policy="Foreground", **kw),
            }
        batch = client.BatchV1Api(self.api)
        return {
            "create": lambda body, **kw: batch.create_namespaced_job(ns, body, field_validation="Strict", **kw),
            "read": lambda **kw: batch.read_namespaced_job(name, ns, **kw),
            "patch": lambda body, **kw: batch.patch_namespaced_job(name, ns, body, _content_type=MERGE_PATCH, **kw),
            "delete": lambda **kw: batch.delete_namespaced_job(name, ns, propagation_policy="Foreground", **kw),
        }

    def _pods(self, names: manifests.Names, job_id: int, attempt: int | None) -> list[dict]:
        core = client.CoreV1Api(self.api)
        got = self._call("list the job's pods", core.list_namespaced_pod, names.namespace,
                         label_selector=manifests.selector(job_id, attempt))
        return sorted(got.get("items", []), key=node_rank)

    # -- launch ---------------------------------------------------------------------------------------

    def launch(self, job: Job, *, token: str | None) -> dict:
        """Create attempt ``job.attempt``: workload (suspended), Service, Secret, then let pods start.

        Every step is idempotent, so a retried task finishes a half-done launch:
        0. Refuse what the spec alone shows would fail (``manifests.spec_problems``): nothing is created.
        1. Create the Job/JobSet suspended (409 with this attempt = ours already; an older attempt is
           deleted first, waiting for it to go).
        2. Create the headless Service and the token Secret, owned by the workload (409 = patch them).
           ``token=None`` (a job-level restart of the lead's flow) keeps the Secret kept by ``stop``.
        3. Unsuspend: only now can pods start, with their Secret and DNS name in place.
        """
        spec = job.job_spec
        problems = manifests.spec_problems(spec)
        if problems:
            raise LaunchError("; ".join(problems))
        names = manifests.names_for(spec, job.pk)
        ops = self._workload_ops(names)
        owner = self._create_workload(ops, names, manifests.workload(spec, job_id=job.pk, attempt=job.attempt),
                                      attempt=job.attempt)
        core = client.CoreV1Api(self.api)
        if not names.use_jobset:
            svc = manifests.headless_service(spec, job_id=job.pk, attempt=job.attempt, owner=owner)
            if self._call("create the headless Service", core.create_namespaced_service, names.namespace, svc,
                          allow=(409,)) is None:
                self._call("update the headless Service", core.patch_namespaced_service, names.service,
                           names.namespace, {"metadata": {k: svc["metadata"][k] for k in ("labels", "ownerReferences")},
                                             "spec": {"selector": svc["spec"]["selector"]}},
                           _content_type=MERGE_PATCH)
        self._ensure_secret(spec, job, token=token, owner=owner)
        self._call(f"start the {names.kind}", ops["patch"], {"spec": {"suspend": False}})
        log.info("job %s attempt %s: %s %s/%s created", job.pk, job.attempt, names.kind, names.namespace,
                 names.workload)
        return {"namespace": names.namespace, "kind": names.kind, "name": names.workload,
                "uid": owner["metadata"]["uid"], "attempt": job.attempt, "secret": names.secret,
                "service": names.service, "rdzv_endpoint": f"{names.rdzv_host}:{manifests.RDZV_PORT}"}

    def _create_workload(self, ops: dict, names: manifests.Names, body: dict, *, attempt: int) -> dict:
        what = f"create the {names.kind} {names.namespace}/{names.workload}"
        for _ in range(2):
            created = self._call(what, ops["create"], body, allow=(409,))
            if created is not None:
                created.setdefault("apiVersion", names.api_version)
                created.setdefault("kind", names.kind)
                return created
            existing = self._call(f"read the {names.kind}", ops["read"], allow=(404,))
            if existing is None:
                continue  # deleted in between: create again
            meta = existing.get("metadata", {})
            if meta.get("labels", {}).get(manifests.L_ATTEMPT) == str(attempt) and not meta.get("deletionTimestamp"):
                existing.setdefault("apiVersion", names.api_version)
                existing.setdefault("kind", names.kind)
                return existing  # a retried launch of this attempt
            # An older attempt is still there (its stop did not finish): it must go first.
            if not meta.get("deletionTimestamp"):
                self._call(f"delete the previous {names.kind}", ops["delete"], allow=(404,))
            try:
                self._wait_gone(names, ops, job_id=None, deadline_s=self.delete_wait_s)
            except TransientLaunchError:
                break
        raise TransientLaunchError(f"{what}: the previous attempt's {names.kind} is still being deleted; retrying")

    def _ensure_secret(self, spec: JobSpec, job: Job, *, token: str | None, owner: dict) -> None:
        names = manifests.names_for(spec, job.pk)
        core = client.CoreV1Api(self.api)
        ref = manifests.owner_reference(owner)
        if token is None:
            patch = {"metadata": {"ownerReferences": [ref], "labels": manifests.labels(job.pk, job.attempt)}}
            if self._call("adopt the job's token Secret", core.patch_namespaced_secret, names.secret,
                          names.namespace, patch, _content_type=MERGE_PATCH, allow=(404,)) is None:
                raise LaunchError(f"the job's token Secret {names.namespace}/{names.secret} is gone and no new "
                                  "token was issued: the pods could not report. Issue a new token for this attempt "
                                  "(launch(job, token=...)) or start a new job")
            return
        body = manifests.token_secret(spec, job_id=job.pk, attempt=job.attempt, token=token,
                                      report_url=self.ingest_url, owner=owner)
        if self._call("create the token Secret", core.create_namespaced_secret, names.namespace, body,
                      allow=(409,)) is None:
            self._call("update the token Secret", core.patch_namespaced_secret, names.secret, names.namespace,
                       {"metadata": {k: body["metadata"][k] for k in ("labels", "ownerReferences")},
                        "data": body["data"]}, _content_type=MERGE_PATCH)

    # -- stop -----------------------------------------------------------------------------------------

    def stop(self, job: Job, *, grace_s: float) -> None:
        """Delete the attempt (foreground: the Job goes last, after its pods); return when nothing is left.

        During a job-level restart (status recovering) the token Secret is kept, un-owned, for the next
        attempt (the control plane stores only the token's hash); otherwise it is deleted too.
        Raises TransientLaunchError when pods are still terminating after the grace period and
        ``delete_wait_s``: the task retries, and a repeated stop is harmless.
        """
        spec = job.job_spec
        names = manifests.names_for(spec, job.pk)
        ops = self._workload_ops(names)
        core = client.CoreV1Api(self.api)
        keep_token = job.status == JobStatus.RECOVERING
        if keep_token:
            self._call("keep the token Secret", core.patch_namespaced_secret, names.secret, names.namespace,
                       {"metadata": {"ownerReferences": None}}, _content_type=MERGE_PATCH, allow=(404,))
        self._call(f"delete the {names.kind}", ops["delete"], allow=(404,))
        grace = max(0, int(grace_s))
        for pod in self._pods(names, job.pk, None):
            if not pod["metadata"].get("deletionTimestamp"):
                self._call("delete a pod", core.delete_namespaced_pod, pod["metadata"]["name"], names.namespace,
                           grace_period_seconds=grace, allow=(404,))
        if not names.use_jobset:
            self._call("delete the headless Service", core.delete_namespaced_service, names.service,
                       names.namespace, allow=(404,))
        if not keep_token:
            self._call("delete the token Secret", core.delete_namespaced_secret, names.secret, names.namespace,
                       allow=(404,))
        self._wait_gone(names, ops, job_id=job.pk, deadline_s=grace + self.delete_wait_s)

    def hold(self, job: Job) -> str:
        """Keep the attempt's objects for debugging: nothing is deleted, so failed containers keep their
        status, termination message and logs, and ``kubectl exec`` reaches running ones. The API offers no
        way to freeze a running container, so a trainer still running in a pod runs on until Stop."""
        names = manifests.names_for(job.job_spec, job.pk)
        pods = self._pods(names, job.pk, job.attempt)
        running = [p["metadata"]["name"] for p in pods if p.get("status", {}).get("phase") == "Running"]
        return (f"{names.kind} {names.namespace}/{names.workload} and its {len(pods)} pod(s) kept"
                + (f" ({len(running)} still running: {', '.join(running[:4])})" if running else "")
                + "; Stop deletes them")

    def _wait_gone(self, names: manifests.Names, ops: dict, *, job_id: int | None, deadline_s: float) -> None:
        deadline = time.monotonic() + deadline_s
        delay = 0.2
        while True:
            left = self._call(f"read the {names.kind}", ops["read"], allow=(404,))
            pods = self._pods(names, job_id, None) if job_id is not None else []
            if left is None and not pods:
                return
            if time.monotonic() >= deadline:
                raise TransientLaunchError(
                    f"{names.kind} {names.namespace}/{names.workload} is still terminating "
                    f"({len(pods)} pod(s) left); retrying")
            self.sleep(delay)
            delay = min(delay * 2, 5.0)

    # -- poll -----------------------------------------------------------------------------------------

    def poll(self, job: Job) -> PollResult:
        spec = job.job_spec
        names = manifests.names_for(spec, job.pk)
        workload = self._call(f"read the {names.kind}", self._workload_ops(names)["read"], allow=(404,))
        if workload is None:
            return PollResult(state="lost", reason=f"the {names.kind} {names.namespace}/{names.workload} is gone "
                                                   "(deleted outside the control plane?)")
        meta = workload.get("metadata", {})
        if meta.get("deletionTimestamp"):
            return PollResult(state="pending", reason=f"the {names.kind} is being deleted")
        if meta.get("labels", {}).get(manifests.L_ATTEMPT) != str(job.attempt):
            return PollResult(state="pending", reason=f"attempt {job.attempt} is not created yet")
        pods = self._pods(names, job.pk, job.attempt)
        events: list[dict] = []
        if needs_events(workload, pods, spec.nodes):
            core = client.CoreV1Api(self.api)
            got = self._call("list events", core.list_namespaced_event, names.namespace, field_selector="type=Warning")
            wanted = {names.workload} | {p["metadata"]["name"] for p in pods}
            events = [e for e in got.get("items", []) if e.get("involvedObject", {}).get("name") in wanted]
        return summarize(workload, pods, events, nodes=spec.nodes, procs_per_node=spec.procs_per_node)

    def log_tail(self, job: Job, *, max_bytes: int = 16384, node_rank: int | None = None) -> str:
        """The end of the log of ``node_rank``'s pod, else of the first failed pod, else of node 0's."""
        spec = job.job_spec
        names = manifests.names_for(spec, job.pk)
        pods = self._pods(names, job.pk, job.attempt)
        if node_rank is not None:
            pods = [p for p in pods if _pod_node_rank(p) == node_rank]
        if not pods:
            return ""
        pod = next((p for p in pods if p.get("status", {}).get("phase") == "Failed"), pods[0])
        name = pod["metadata"]["name"]
        text = self._call("read the pod's log", client.CoreV1Api(self.api).read_namespaced_pod_log, name,
                          names.namespace, container=manifests.CONTAINER, tail_lines=2000, allow=(400, 404), text=True)
        if not text:
            return ""
        data = text.encode()
        if len(data) > max_bytes:
            text = data[-max_bytes:].decode("utf-8", "ignore").split("\n", 1)[-1]
        return text

    # -- preflight ------------------------------------------------------------------------------------

    def preflight(self, job: Job) -> list[str]:
        """Problems that would make the launch fail, as messages for the new-job form (empty = fine).

        Works on an unsaved Job (the form's spec): only ``job.spec`` is read.
        """
        spec = job.job_spec
        k8s = spec.kubernetes
        if k8s is None:
            return ["the kubernetes backend needs its settings (namespace, image, ...)"]
        problems = manifests.spec_problems(spec) + nvrx_problems(spec, k8s.nvrx_version)
        try:
            problems += self._cluster_problems(spec)
        except (LaunchError, TransientLaunchError) as e:
            problems.append(str(e))
        return problems

    def _cluster_problems(self, spec: JobSpec) -> list[str]:
        k8s = spec.kubernetes
        assert k8s is not None
        core = client.CoreV1Api(self.api)
        t = PREFLIGHT_TIMEOUT
        try:
            self._call("reach the API server", client.VersionApi(self.api).get_code, allow=(403, 404), timeout=t)
        except TransientLaunchError:
            host = self.api.configuration.host
            return [f"cannot reach the Kubernetes API server at {host}: check KUBECONFIG (or the in-cluster "
                    "service account) and the network path from the control plane"]
        problems = []
        if self._call("read the namespace", core.read_namespace, k8s.namespace, allow=(403, 404), timeout=t) is None \
                and self._allowed("get", "namespaces", ""):
            return [f"namespace {k8s.namespace!r} does not exist: create it (kubectl create namespace "
                    f"{k8s.namespace}) or choose another"]
        pvc = self._call("read the checkpoint claim", core.read_namespaced_persistent_volume_claim,
                         k8s.checkpoint_claim, k8s.namespace, allow=(404,), timeout=t)
        if pvc is None:
            problems.append(f"the checkpoint claim {k8s.checkpoint_claim!r} does not exist in namespace "
                            f"{k8s.namespace!r}: create a ReadWriteMany PersistentVolumeClaim (FSx for Lustre, see "
                            "deploy/README.md) or name an existing one")
        else:
            modes = pvc.get("spec", {}).get("accessModes") or []
            if spec.nodes > 1 and "ReadWriteMany" not in modes:
                problems.append(f"the checkpoint claim {k8s.checkpoint_claim!r} is {', '.join(modes) or 'not shared'}: "
                                f"{spec.nodes} nodes write checkpoints to it, so it must be ReadWriteMany")
            if pvc.get("status", {}).get("phase") == "Lost":
                problems.append(f"the checkpoint claim {k8s.checkpoint_claim!r} lost its volume: recreate it")
            sc = pvc.get("spec", {}).get("storageClassName")
            if sc and pvc.get("status", {}).get("phase") == "Pending":
                st = client.StorageV1Api(self.api)
                if self._call("read the storage class", st.read_storage_class, sc, allow=(403, 404), timeout=t) \
                        is None and self._allowed("get", "storageclasses", ""):
                    problems.append(f"the checkpoint claim {k8s.checkpoint_claim!r} waits for storage class {sc!r}, "
                                    "which does not exist: install its CSI driver (e.g. FSx for Lustre) or fix the claim")
        if k8s.use_jobset:
            found = self._call("look up the JobSet API", client.CustomObjectsApi(self.api).get_api_resources,
                               *JOBSET[:2], allow=(404,), timeout=t)
            if found is None:
                problems.append("JobSet (jobset.x-k8s.io/v1alpha2) is not installed in this cluster: install it "
                                "or turn use_jobset off (the default Indexed Job needs no add-on)")
        problems += self._capacity_problems(spec, timeout=t)
        return problems

    def _allowed(self, verb: str, resource: str, namespace: str) -> bool:
        """Whether this service account may read ``resource`` (403 above means: cannot tell)."""
        review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                  "spec": {"resourceAttributes": {"verb": verb, "resource": resource, "namespace": namespace}}}
        try:
            got = self._call("check permissions", client.AuthorizationV1Api(self.api)
                             .create_self_subject_access_review, review, allow=(403, 404), timeout=PREFLIGHT_TIMEOUT)
        except (LaunchError, TransientLaunchError):
            return False
        return bool(got and got.get("status", {}).get("allowed"))

    def _capacity_problems(self, spec: JobSpec, *, timeout: tuple[float, float]) -> list[str]:
        k8s = spec.kubernetes
        assert k8s is not None
        sel = ",".join(f"{k}={v}" for k, v in sorted(k8s.node_selector.items())) or None
        got = self._call("list nodes", client.CoreV1Api(self.api).list_node, label_selector=sel, allow=(403,),
                         timeout=timeout)
        if got is None:
            log.warning("preflight: may not list nodes (RBAC); GPU fit not checked")
            return []
        nodes = got.get("items", [])
        where = f" matching node_selector {k8s.node_selector}" if k8s.node_selector else ""
        if not nodes:
            return [f"no node{where} in the cluster: fix node_selector, or scale up the GPU node group first "
                    "(a node group that scales from zero shows no nodes until it has one)"]
        problems = []
        for resource, want, field in (("nvidia.com/gpu", k8s.gpus_per_node, "gpus_per_node"),
                                      ("vpc.amazonaws.com/efa", k8s.efa_per_node, "efa_per_node")):
            if not want:
                continue
            have = max(_quantity(n.get("status", {}).get("allocatable", {}).get(resource)) for n in nodes)
            if have < want:
                problems.append(f"each pod asks for {want} {resource} but the largest node{where} has {have} "
                                f"allocatable: lower {field} to {have} or add bigger nodes"
                                + (" (is the NVIDIA device plugin installed?)" if resource == "nvidia.com/gpu" and
                                   not have else "")
                                + (" (is the EFA device plugin installed? set efa_per_node to 0 without EFA)"
                                   if resource == "vpc.amazonaws.com/efa" and not have else ""))
        return problems


# -- API errors and quantities ------------------------------------------------------------------------------


def _translate(e: ApiException, what: str) -> Exception:
    message = ""
    try:
        message = json.loads(e.body or "{}").get("message", "")
    except (ValueError, AttributeError):
        message = (e.body or "")[:300] if isinstance(e.body, str) else ""
    detail = f": {message}" if message else ""
    if e.status in TRANSIENT_STATUSES:
        return TransientLaunchError(f"{what}: the API server answered {e.status}{detail}; retrying")
    if e.status == 409:
        return TransientLaunchError(f"{what}: conflict{detail}; retrying")
    if e.status == 401:
        return LaunchError(f"{what}: the API server refused the control plane's credentials (401): check "
                           "KUBECONFIG or the service account token")
    if e.status == 403:
        return LaunchError(f"{what}: forbidden (403){detail}. The control plane's service account needs the Role "
                           "in deploy/k8s/base/rbac.yaml in the job's namespace")
    if e.status == 404:
        return LaunchError(f"{what}: not found{detail}")
    if e.status in (400, 422):
        return LaunchError(f"{what}: the cluster refused it{detail}")
    return LaunchError(f"{what}: the API server answered {e.status}{detail}")


def _quantity(text: Any) -> int:
    try:
        return int(str(text or "0"))
    except ValueError:
        return 0
