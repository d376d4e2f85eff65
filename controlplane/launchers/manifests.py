"""Kubernetes manifests for one attempt of one job, as plain dicts. Pure functions, tested as data.

Shape (default): an Indexed ``batch/v1`` Job, one pod per node (parallelism = completions = nodes,
restartPolicy Never, backoffLimit 0: job-level restarts belong to the control plane), a headless Service
whose name is the pods' subdomain, and a Secret with the job's ingest token and URL. With
``use_jobset`` a JobSet replaces Job and Service (the JobSet controller makes the headless Service).

Rendezvous works for any number of nodes because every pod reaches node 0 by a stable DNS name:
an Indexed Job with ``subdomain`` set gives pod ``i`` the hostname ``<job>-<i>``, so node 0 is
``<job>-0.<service>.<namespace>.svc`` (JobSet: ``<jobset>-<replicatedJob>-0-0.<subdomain>...``).
The Service publishes not-ready addresses, so the name resolves as soon as the pod has an IP.

Names derive from the job id alone (``unbroken-<id>``), so a retried create is a 409 on the same
object, never a duplicate; the attempt is a label. The Secret and Service carry an owner reference to
the workload, so deleting the Job deletes its pods, Service and Secret.

The user's own code (``spec.entrypoint``) runs in the user's image under the same launcher: the container
runs ``[*kubernetes.command,] python -m trainer.launch --node-rank ... --run-dir ...`` with the spec in its env,
with ``spec.env`` as plain env entries and ``spec.working_dir`` as its ``workingDir``. Everything that
comes from the spec reaches the process literally: the kubelet expands ``$(VAR)`` in command, args and
env values, so the spec's ``$`` are written as ``$$``; only the launcher's own references expand.
"""

from __future__ import annotations

import base64
import posixpath
import re
import shlex
from dataclasses import dataclass
from typing import Any

from controlplane.jobs.spec import SECRET_ENV, JobSpec, KubernetesSpec
from controlplane.launchers.command import RDZV_PORT, TRAINER_LAUNCH, launch_args, launch_env

PREFIX = "unbroken"
CONTAINER = "trainer"
CHECKPOINT_MOUNT = "/checkpoints"
TOKEN_DIR = "/var/run/secrets/unbroken"
USER_SECRETS_DIR = "/var/run/secrets/user"  # kubernetes.secrets: <dir>/<secret name>/<key>
TOKEN_KEY = "token"
REPORT_URL_KEY = "report-url"
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
JOBSET_REPLICATED_JOB = "node"
# Label keys. The attempt label tells this attempt's pods from a previous one still terminating.
L_NAME = "app.kubernetes.io/name"
L_PART_OF = "app.kubernetes.io/part-of"
L_MANAGED_BY = "app.kubernetes.io/managed-by"
L_JOB_ID = "unbroken.dev/job-id"
L_ATTEMPT = "unbroken.dev/attempt"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
# A pod on an unreachable or not-ready node is evicted after this long instead of the default 300 s,
# so a lost node becomes a failed pod (and a node_lost fault) within a minute.
NODE_LOST_TOLERATION_S = 60
# SIGTERM -> SIGKILL: time for the trainer to finish an in-flight checkpoint when a pod is deleted.
TERMINATION_GRACE_S = 60

NCCL_ENV = {
    "NCCL_DEBUG": "WARN",
    "NCCL_NVLS_ENABLE": "0",
    "NCCL_SOCKET_IFNAME": "^lo,docker",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "TORCH_CPP_LOG_LEVEL": "ERROR",  # NVRx's Wrapper polls its store every 500 ms and warns each time
    "PYTHONUNBUFFERED": "1",
}
EFA_ENV = {
    "FI_PROVIDER": "efa",
    "FI_EFA_USE_DEVICE_RDMA": "1",
    "FI_EFA_FORK_SAFE": "1",
}


@dataclass(frozen=True, slots=True)
class Names:
    """Every name of one job's objects, from its id."""

    job_id: int
    namespace: str
    use_jobset: bool

    @property
    def workload(self) -> str:
        return f"{PREFIX}-{self.job_id}"

    @property
    def service(self) -> str:
        # JobSet: the controller names the headless Service after network.subdomain, which we set.
        return self.workload

    @property
    def secret(self) -> str:
        return f"{PREFIX}-{self.job_id}-token"

    @property
    def kind(self) -> str:
        return "JobSet" if self.use_jobset else "Job"

    @property
    def api_version(self) -> str:
        return JOBSET_API if self.use_jobset else "batch/v1"

    @property
    def rdzv_host(self) -> str:
        """Node 0's stable DNS name, the same from every pod."""
        first = f"{self.workload}-{JOBSET_REPLICATED_JOB}-0-0" if self.use_jobset else f"{self.workload}-0"
        return f"{first}.{self.service}.{self.namespace}.svc"

    @property
    def run_dir(self) -> str:
        # Same for every attempt, so a recreated job resumes from the last durable checkpoint.
        return f"{CHECKPOINT_MOUNT}/{self.workload}"


def names_for(spec: JobSpec, job_id: int) -> Names:
    k8s = _k8s(spec)
    return Names(job_id=job_id, namespace=k8s.namespace, use_jobset=k8s.use_jobset)


def _k8s(spec: JobSpec) -> KubernetesSpec:
    if spec.kubernetes is None:
        raise ValueError("not a kubernetes job: spec.kubernetes is empty")
    return spec.kubernetes


def labels(job_id: int, attempt: int) -> dict[str, str]:
    return {
        L_NAME: "unbroken-trainer",
        L_PART_OF: "unbroken",
        L_MANAGED_BY: "unbroken-controlplane",
        L_JOB_ID: str(job_id),
        L_ATTEMPT: str(attempt),
    }


def selector(job_id: int, attempt: int | None = None) -> str:
    """Label selector of a job's pods (of one attempt, when given)."""
    sel = f"{L_JOB_ID}={job_id}"
    return sel if attempt is None else f"{sel},{L_ATTEMPT}={attempt}"


def owner_reference(owner: dict[str, Any]) -> dict[str, Any]:
    """An owner reference to a created object (needs its uid): deleting the owner deletes the dependent."""
    meta = owner["metadata"]
    return {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


def literal(text: str) -> str:
    """``text`` as the kubelet passes it on: it expands ``$(VAR)`` in command, args and env values and
    reads ``$$`` as one ``$``, so doubling every ``$`` leaves nothing to expand."""
    return text.replace("$", "$$")


def container_args(spec: JobSpec, *, job_id: int, attempt: int) -> list[str]:
    """``trainer.launch`` arguments of every pod; the runtime fills in the node rank and the ingest URL.

    The settings travel in the spec's environment variable (``launch_env``); the working directory is
    passed literally."""
    names = names_for(spec, job_id)
    argv = launch_args(
        spec,
        node_rank="$(JOB_COMPLETION_INDEX)",
        rdzv_endpoint=f"{names.rdzv_host}:{RDZV_PORT}",
        run_dir=names.run_dir,
        job_id=job_id,
        attempt=attempt,
        report_url="$(UNBROKEN_REPORT_URL)",
        working_dir=literal(spec.working_dir),
    )
    return argv


def container_command(spec: JobSpec) -> list[str]:
    """The launcher, under the spec's wrapper when it has one (the wrapper must exec its arguments)."""
    return [*(literal(c) for c in _k8s(spec).command), *TRAINER_LAUNCH]


def _env(spec: JobSpec, ours: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Our env, then the spec's: a spec value replaces one of our plain defaults (NCCL_*, FI_*) in place.

    The spec cannot name the launcher's variables (spec.py refuses them) nor the pod's identity
    (``POD_ENV``: refused by ``spec_problems``)."""
    env = [dict(e) for e in ours]
    index = {e["name"]: i for i, e in enumerate(env) if "value" in e}
    for name, value in spec.env.items():
        entry = {"name": name, "value": literal(value)}
        if name in index:
            env[index[name]] = entry
        else:
            env.append(entry)
    return env


def _ports(key: str) -> list[dict[str, Any]]:
    """Node 0 serves the rendezvous on RDZV_PORT, the app store on +1 and NVRx's Wrapper store on +2."""
    return [{"name": name, key: RDZV_PORT + i, "protocol": "TCP"}
            for i, name in enumerate(("rdzv", "app-store", "wrapper-store"))]


def pod_template(spec: JobSpec, *, job_id: int, attempt: int) -> dict[str, Any]:
    k8s = _k8s(spec)
    names = names_for(spec, job_id)
    env = _pod_env(spec, names.secret, job_id=job_id, attempt=attempt)
    accelerators: dict[str, str] = {}
    if k8s.gpus_per_node:
        accelerators["nvidia.com/gpu"] = str(k8s.gpus_per_node)
    if k8s.efa_per_node:
        accelerators["vpc.amazonaws.com/efa"] = str(k8s.efa_per_node)
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": k8s.image,
        "imagePullPolicy": k8s.image_pull_policy,
        "command": container_command(spec),
        "args": container_args(spec, job_id=job_id, attempt=attempt),
        "env": _env(spec, env),
        "ports": _ports("containerPort"),
        # Extended resources: requests must equal limits; the scheduler places one pod per node by them.
        "resources": {"limits": dict(accelerators), "requests": dict(accelerators)},
        "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},  # EFA registers (pins) memory
        "volumeMounts": [
            {"name": "checkpoints", "mountPath": CHECKPOINT_MOUNT},
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "job-token", "mountPath": TOKEN_DIR, "readOnly": True},
        ],
        # On failure the log tail becomes the termination message: the poll shows it with the exit code.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if spec.working_dir:
        container["workingDir"] = spec.working_dir  # not expanded by the kubelet: as written
    for i, secret in enumerate(k8s.secrets):
        container["volumeMounts"].append({"name": f"user-secret-{i}", "readOnly": True,
                                          "mountPath": f"{USER_SECRETS_DIR}/{secret}"})
    tolerations = _tolerations(k8s)
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [container],
        "volumes": [
            {"name": "checkpoints", "persistentVolumeClaim": {"claimName": k8s.checkpoint_claim}},
            # NCCL and the DCP stager need far more shared memory than a container's 64 MiB default.
            {"name": "dshm", "hostPath": {"path": "/dev/shm", "type": "Directory"}},
            {"name": "job-token", "secret": {"secretName": names.secret, "defaultMode": 0o440,
                                             "items": [{"key": TOKEN_KEY, "path": TOKEN_KEY}]}},
            *({"name": f"user-secret-{i}", "secret": {"secretName": secret, "defaultMode": 0o440}}
              for i, secret in enumerate(k8s.secrets)),
        ],
        "tolerations": tolerations,
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
        "enableServiceLinks": False,
        # The training code never calls the Kubernetes API: no service account token in its pods.
        "automountServiceAccountToken": False,
    }
    if k8s.node_selector:
        pod_spec["nodeSelector"] = dict(k8s.node_selector)
    if not k8s.use_jobset:
        # Indexed Job + subdomain: the Job controller sets hostname <job>-<index>. (JobSet sets both.)
        pod_spec["subdomain"] = names.service
    return {"metadata": {"labels": labels(job_id, attempt)}, "spec": pod_spec}


def _pod_env(spec: JobSpec, secret: str, *, job_id: int, attempt: int) -> list[dict[str, Any]]:
    """The training container's environment before ``_env`` adds the user's: its index, token and report
    URL, the job's launch settings, where it runs, and NCCL's (and EFA's) settings."""
    k8s = _k8s(spec)
    env: list[dict[str, Any]] = [
        # Expanded by the kubelet in the args ($(VAR)); set here so it does not depend on the Job
        # controller's injection (which skips a container that already defines it).
        {"name": "JOB_COMPLETION_INDEX",
         "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX}']"}}},
        {"name": "UNBROKEN_TOKEN_FILE", "value": f"{TOKEN_DIR}/{TOKEN_KEY}"},
        {"name": "UNBROKEN_REPORT_URL",
         "valueFrom": {"secretKeyRef": {"name": secret, "key": REPORT_URL_KEY}}},
        {"name": "UNBROKEN_JOB_ID", "value": str(job_id)},
        {"name": "UNBROKEN_ATTEMPT", "value": str(attempt)},
        *({"name": k, "value": literal(v)} for k, v in launch_env(spec).items()),
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    env += [{"name": k, "value": v} for k, v in NCCL_ENV.items()]
    if k8s.efa_per_node:
        env += [{"name": k, "value": v} for k, v in EFA_ENV.items()]
    return env


def _tolerations(k8s: KubernetesSpec) -> list[dict[str, Any]]:
    """The user's tolerations, GPU nodes' taint, and an unreachable or not-ready node tolerated for only
    ``NODE_LOST_TOLERATION_S``, so a lost node becomes a failed pod within a minute."""
    tolerations = [dict(t) for t in k8s.tolerations]
    if k8s.gpus_per_node and not any(t.get("key") == "nvidia.com/gpu" for t in tolerations):
        tolerations.append({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"})
    for key in ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready"):
        if not any(t.get("key") == key for t in tolerations):
            tolerations.append({"key": key, "operator": "Exists", "effect": "NoExecute",
                                "tolerationSeconds": NODE_LOST_TOLERATION_S})
    return tolerations


def _job_spec(spec: JobSpec, *, job_id: int, attempt: int) -> dict[str, Any]:
    return {
        "completionMode": "Indexed",
        "completions": spec.nodes,
        "parallelism": spec.nodes,
        # One failed pod fails the whole attempt; the control plane decides about the next one.
        "backoffLimit": 0,
        "template": pod_template(spec, job_id=job_id, attempt=attempt),
    }


def workload(spec: JobSpec, *, job_id: int, attempt: int) -> dict[str, Any]:
    """The Job (or JobSet), created suspended: its Secret and Service exist before any pod starts."""
    names = names_for(spec, job_id)
    meta = {"name": names.workload, "namespace": names.namespace, "labels": labels(job_id, attempt),
            "annotations": {"unbroken.dev/rdzv-endpoint": f"{names.rdzv_host}:{RDZV_PORT}"}}
    if not names.use_jobset:
        return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
                "spec": {**_job_spec(spec, job_id=job_id, attempt=attempt), "suspend": True}}
    job_template = {"metadata": {"labels": labels(job_id, attempt)},
                    "spec": _job_spec(spec, job_id=job_id, attempt=attempt)}
    return {
        "apiVersion": JOBSET_API, "kind": "JobSet", "metadata": meta,
        "spec": {
            "suspend": True,
            "network": {"enableDNSHostnames": True, "subdomain": names.service, "publishNotReadyAddresses": True},
            "failurePolicy": {"maxRestarts": 0},
            "successPolicy": {"operator": "All"},
            "replicatedJobs": [{"name": JOBSET_REPLICATED_JOB, "replicas": 1, "template": job_template}],
        },
    }


def headless_service(spec: JobSpec, *, job_id: int, attempt: int, owner: dict[str, Any]) -> dict[str, Any]:
    names = names_for(spec, job_id)
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": names.service, "namespace": names.namespace, "labels": labels(job_id, attempt),
                     "ownerReferences": [owner_reference(owner)]},
        "spec": {
            "clusterIP": "None",
            "selector": {L_JOB_ID: str(job_id), L_ATTEMPT: str(attempt)},
            # Rendezvous starts before any pod is Ready (the trainer has no readiness probe).
            "publishNotReadyAddresses": True,
            "ports": [{**p, "targetPort": p["port"]} for p in _ports("port")],
        },
    }


def token_secret(spec: JobSpec, *, job_id: int, attempt: int, token: str, report_url: str,
                 owner: dict[str, Any]) -> dict[str, Any]:
    """The ingest token (mounted as a file) and URL: never inline in the pod spec."""
    names = names_for(spec, job_id)

    def b64(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    return {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {"name": names.secret, "namespace": names.namespace, "labels": labels(job_id, attempt),
                     "ownerReferences": [owner_reference(owner)]},
        "data": {TOKEN_KEY: b64(token), REPORT_URL_KEY: b64(report_url)},
    }


def render(spec: JobSpec, *, job_id: int, attempt: int, token: str, report_url: str,
           owner: dict[str, Any]) -> list[dict[str, Any]]:
    """Everything one attempt creates, in order, given the created workload (``owner``, with its uid)."""
    objs = [workload(spec, job_id=job_id, attempt=attempt)]
    if not names_for(spec, job_id).use_jobset:
        objs.append(headless_service(spec, job_id=job_id, attempt=attempt, owner=owner))
    objs.append(token_secret(spec, job_id=job_id, attempt=attempt, token=token, report_url=report_url,
                             owner=owner))
    return objs


# -- what can be checked without the cluster ------------------------------------------------------------

# Set from the pod itself (fieldRef): the node rank in the launcher's args, and where a fault happened.
POD_ENV = frozenset({"JOB_COMPLETION_INDEX", "NODE_NAME", "POD_NAME", "POD_IP"})
_SHELLS = frozenset({"sh", "bash", "dash", "ash", "ksh", "zsh"})
_EXECS_ARGS = re.compile(r"\bexec\b[^;&|\n]*\$\{?@")  # exec "$@", exec env X=1 "$@", exec tini -- "${@}"
# NAME=value written out (not NAME=$(cat /var/run/secrets/...), which reads it where it is kept)
_ASSIGNMENT = re.compile(r"(?<![A-Za-z0-9_])([A-Za-z_][A-Za-z0-9_]*)=(?![\"']?\$)\S")
_DEFAULT_IMAGE = KubernetesSpec().image


def spec_problems(spec: JobSpec) -> list[str]:
    """What would make this spec's pods fail that needs no cluster to see, as ``field: message``.

    The image's contents cannot be checked from here: whether the entrypoint exists in it is found when
    the pod starts (the launcher exits 3 and the job fails without a job-level restart)."""
    k8s = _k8s(spec)
    problems = [f"kubernetes.command: {p}" for p in _command_problems(k8s.command)]
    problems += [f"env: {name} is set by the pod (node rank, node and pod names): choose another name"
                 for name in sorted(POD_ENV & set(spec.env))]
    if not spec.entrypoint:
        return problems
    if k8s.image == _DEFAULT_IMAGE:
        problems.append(f"kubernetes.image: {_DEFAULT_IMAGE} holds only Unbroken's own trainer: name the image "
                        "with your code and the unbroken-sdk package (deploy/README.md, \"Your own training "
                        "image\")")
    for name in ("entrypoint", "working_dir"):
        value = getattr(spec, name)
        if value.startswith("~") or "$" in value:
            problems.append(f"{name}: no shell expands ~ or $VARIABLES here: write the path as it is inside "
                            "the image")
    return problems


def _command_problems(command: list[str]) -> list[str]:
    """A wrapper must run the launcher's argv (appended to it) with exec, so the launcher is PID 1 and
    receives SIGTERM when the pod is deleted. A shell script file cannot be seen from here."""
    if not command:
        return []
    if any("trainer.launch" in c for c in command):
        return ["is the wrapper the launcher runs under: the control plane appends python -m trainer.launch "
                "and its flags itself, leave them out"]
    problems = [f"{name}=... puts a secret on the command line (stored with the job, shown in the pod spec): "
                "keep it in a Kubernetes Secret the wrapper or your code reads"
                for c in command for name in _ASSIGNMENT.findall(c) if SECRET_ENV.search(name)]
    i = 0
    if posixpath.basename(command[0]) == "env":  # env [-i] [NAME=value...] PROGRAM ...
        i = 1
        while i < len(command) and (command[i].startswith("-") or "=" in command[i]):
            i += 1
    if i >= len(command) or posixpath.basename(command[i]) not in _SHELLS:
        return problems  # tini, dumb-init, env NAME=value, a profiler...: they run their arguments
    shell, opts = command[i], command[i + 1:]
    c = 0  # the option cluster with c (-c, -lc, -ec), after others: -e, -o pipefail, --norc, --rcfile F
    while c < len(opts) and opts[c].startswith(("-", "+")) and opts[c] != "--":
        if not opts[c].startswith("--") and "c" in opts[c][1:]:
            break
        c += 2 if opts[c] in ("-o", "+o", "-O", "+O", "--rcfile", "--init-file") else 1
    else:
        script_file = opts[c + 1:] if c < len(opts) and opts[c] == "--" else opts[c:]
        if script_file:
            return problems  # it must exec "$@" too (deploy/README.md), but it cannot be read from here
        return problems + [f"{shell} without -c or a script runs the launcher's 'python' as a script file: "
                           f"write [\"{shell}\", \"-c\", \"...; exec \\\"$@\\\"\", \"--\"]"]
    if c + 1 >= len(opts):
        return problems + [f"{shell} {opts[c]} needs a script after it"]
    script, rest = opts[c + 1], opts[c + 2:]
    if not _EXECS_ARGS.search(script):
        how = ("runs its arguments without exec: the shell stays PID 1 and the launcher never gets SIGTERM"
               if "$@" in script or "${@}" in script else "never runs its arguments (the launcher)")
        problems.append(f"the script {shlex.quote(script)} {how}; end it with exec \"$@\"")
    if not rest:
        problems.append(f"add \"--\" after the script: {shell} -c takes the next argument as $0, so 'python' "
                        "would be dropped from \"$@\"")
    return problems
