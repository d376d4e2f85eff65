"""Manifests as data: 1, 2 and 16 nodes; rendezvous, resources, volumes, secrets, labels, owner references.
Every object is validated strictly against the pinned Kubernetes schema (and the JobSet schema)."""

import json

import pytest

from controlplane.jobs.spec import JobSpec, SpecError
from controlplane.launchers import manifests
from trainer.jobspec import ENV_SPEC

from k8shelpers import NS, k8s_spec
from kfake import K8S_VERSION, validate_object

OWNER = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "unbroken-42", "uid": "u-1"}}


def render(nodes: int, **k8s):
    spec = k8s_spec(nodes=nodes, kubernetes=k8s)
    return spec, manifests.render(spec, job_id=42, attempt=3, token="ubk_tok", report_url="http://ingest:8000",
                                  owner=OWNER)


def container(obj):
    return obj["spec"]["template"]["spec"]["containers"][0]


def arg(c, flag):
    return c["args"][c["args"].index(flag) + 1]


@pytest.mark.parametrize("nodes", [1, 2, 16])
def test_it_renders_valid_objects_for_any_number_of_nodes(nodes):
    _, objs = render(nodes)
    assert [o["kind"] for o in objs] == ["Job", "Service", "Secret"]
    for obj in objs:
        assert validate_object(obj) == [], (K8S_VERSION, obj["kind"])
    job = objs[0]
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == nodes
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["backoffLimit"] == 0
    assert job["spec"]["suspend"] is True
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    spec_env = {e["name"]: e["value"] for e in container(job)["env"] if e["name"] == ENV_SPEC}
    assert JobSpec.decode(spec_env[ENV_SPEC].replace("$$", "$")).nodes == nodes  # the spec, whole


@pytest.mark.parametrize("nodes", [1, 2, 16])
def test_it_points_every_node_at_node_zero_by_its_stable_name(nodes):
    _, (job, svc, _) = render(nodes)
    pod = job["spec"]["template"]["spec"]
    assert pod["subdomain"] == svc["metadata"]["name"] == "unbroken-42"
    # Indexed Job + subdomain: pod i is <job>-<i>.<subdomain>; node 0 is the rendezvous host.
    assert arg(container(job), "--rdzv-endpoint") == f"unbroken-42-0.unbroken-42.{NS}.svc:29500"
    assert arg(container(job), "--node-rank") == "$(JOB_COMPLETION_INDEX)"
    env = {e["name"]: e for e in container(job)["env"]}
    assert env["JOB_COMPLETION_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {"unbroken.dev/job-id": "42", "unbroken.dev/attempt": "3"}
    assert {p["port"] for p in svc["spec"]["ports"]} == {29500, 29501, 29502}
    assert all(len(f"unbroken-42-{i}") <= 63 for i in range(nodes))


def test_it_requests_gpus_efa_and_the_node_settings():
    _, (job, _, _) = render(2, node_selector={"node-type": "p5"},
                           tolerations=[{"key": "dedicated", "operator": "Equal", "value": "training",
                                         "effect": "NoSchedule"}])
    c, pod = container(job), job["spec"]["template"]["spec"]
    assert c["resources"]["limits"] == c["resources"]["requests"] == {"nvidia.com/gpu": "8",
                                                                     "vpc.amazonaws.com/efa": "32"}
    assert pod["nodeSelector"] == {"node-type": "p5"}
    keys = [t["key"] for t in pod["tolerations"]]
    assert keys == ["dedicated", "nvidia.com/gpu", "node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready"]
    assert pod["tolerations"][2]["tolerationSeconds"] == manifests.NODE_LOST_TOLERATION_S
    assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["FI_PROVIDER"] == "efa" and env["NCCL_NVLS_ENABLE"] == "0"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


def test_it_leaves_out_gpu_and_efa_when_none_are_asked_for():
    _, (job, _, _) = render(1, gpus_per_node=0, efa_per_node=0)
    c = container(job)
    assert c["resources"] == {"limits": {}, "requests": {}}
    assert "FI_PROVIDER" not in {e["name"] for e in c["env"]}
    assert validate_object(job) == []


def test_it_mounts_checkpoints_host_shm_and_the_token_file():
    _, (job, _, secret) = render(2, checkpoint_claim="fsx-lustre-claim")
    c, pod = container(job), job["spec"]["template"]["spec"]
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["checkpoints"]["persistentVolumeClaim"] == {"claimName": "fsx-lustre-claim"}
    assert mounts["checkpoints"]["mountPath"] == "/checkpoints"
    assert arg(c, "--run-dir") == "/checkpoints/unbroken-42"  # the same for every attempt: resume from it
    assert vols["dshm"]["hostPath"] == {"path": "/dev/shm", "type": "Directory"}
    assert mounts["dshm"]["mountPath"] == "/dev/shm"
    assert vols["job-token"]["secret"]["secretName"] == secret["metadata"]["name"] == "unbroken-42-token"
    assert mounts["job-token"]["readOnly"] is True
    assert pod["automountServiceAccountToken"] is False and "serviceAccountName" not in pod
    env = {e["name"]: e for e in c["env"]}
    assert env["UNBROKEN_TOKEN_FILE"]["value"] == f"{mounts['job-token']['mountPath']}/token"
    assert env["UNBROKEN_REPORT_URL"]["valueFrom"]["secretKeyRef"] == {"name": "unbroken-42-token",
                                                                        "key": "report-url"}
    assert arg(c, "--report-url") == "$(UNBROKEN_REPORT_URL)"


def test_it_never_puts_the_token_in_the_workload():
    _, (job, svc, secret) = render(2)
    assert "ubk_tok" not in json.dumps(job) + json.dumps(svc)
    assert "ubk_tok" not in json.dumps(secret)  # base64 in data, not plain text


def test_it_labels_everything_and_owns_service_and_secret_by_the_job():
    _, objs = render(2)
    want = {"app.kubernetes.io/name": "unbroken-trainer", "app.kubernetes.io/part-of": "unbroken",
            "app.kubernetes.io/managed-by": "unbroken-controlplane", "unbroken.dev/job-id": "42",
            "unbroken.dev/attempt": "3"}
    job, svc, secret = objs
    for obj in objs:
        assert obj["metadata"]["labels"] == want
        assert obj["metadata"]["namespace"] == NS
    assert job["spec"]["template"]["metadata"]["labels"] == want
    for obj in (svc, secret):
        assert obj["metadata"]["ownerReferences"] == [{"apiVersion": "batch/v1", "kind": "Job", "name": "unbroken-42",
                                                       "uid": "u-1", "controller": True, "blockOwnerDeletion": True}]


def test_it_names_everything_from_the_job_id_alone():
    a = manifests.render(k8s_spec(), job_id=5, attempt=0, token="a", report_url="u", owner=OWNER)
    b = manifests.render(k8s_spec(), job_id=5, attempt=4, token="b", report_url="u", owner=OWNER)
    assert [o["metadata"]["name"] for o in a] == [o["metadata"]["name"] for o in b] == \
        ["unbroken-5", "unbroken-5", "unbroken-5-token"]


@pytest.mark.parametrize("nodes", [1, 2, 16])
def test_it_renders_a_valid_jobset(nodes):
    spec = k8s_spec(nodes=nodes, kubernetes={"use_jobset": True})
    objs = manifests.render(spec, job_id=42, attempt=0, token="t", report_url="u", owner=OWNER)
    assert [o["kind"] for o in objs] == ["JobSet", "Secret"]
    js = objs[0]
    assert validate_object(js) == []
    assert js["spec"]["network"] == {"enableDNSHostnames": True, "subdomain": "unbroken-42",
                                     "publishNotReadyAddresses": True}
    assert js["spec"]["failurePolicy"] == {"maxRestarts": 0}
    (rj,) = js["spec"]["replicatedJobs"]
    job_spec = rj["template"]["spec"]
    assert (rj["replicas"], job_spec["completions"], job_spec["parallelism"]) == (1, nodes, nodes)
    c = job_spec["template"]["spec"]["containers"][0]
    assert arg(c, "--rdzv-endpoint") == f"unbroken-42-node-0-0.unbroken-42.{NS}.svc:29500"


def test_the_jobset_schema_rejects_unknown_and_mistyped_fields():
    js = manifests.workload(k8s_spec(kubernetes={"use_jobset": True}), job_id=1, attempt=0)
    js["spec"]["replicatedJobs"][0]["replicas"] = "one"
    js["spec"]["sucessPolicy"] = {"operator": "All"}
    js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["imagee"] = "x"
    errors = " ".join(validate_object(js))
    assert "replicas" in errors and "sucessPolicy" in errors and "imagee" in errors


@pytest.mark.parametrize("field,value,message", [
    ("gpus_per_node", -1, "at least 0"),
    ("efa_per_node", 10**6, "at most 1024"),
    ("gpus_per_node", "8", "integer"),
    ("checkpoint_claim", "FSx_Claim", "PersistentVolumeClaim"),
    ("image", " ", "trainer image"),
    ("image_pull_policy", "Sometimes", "Always"),
    ("node_selector", {"a": 1}, "string values"),
])
def test_it_refuses_bad_kubernetes_settings_naming_the_field(field, value, message):
    with pytest.raises(SpecError) as e:
        k8s_spec(kubernetes={field: value})
    assert message in e.value.errors[f"kubernetes.{field}"]
