"""KubernetesLauncher.preflight: problems as messages for the new-job form (unsaved Job, fake cluster)."""

import time

import pytest

from controlplane.launchers.kubernetes import KubernetesLauncher

from k8shelpers import make_job


def test_it_finds_nothing_wrong_on_a_ready_cluster(cluster, launcher):
    cluster.ready()
    assert launcher.preflight(make_job()) == []


def test_it_works_on_an_unsaved_job_from_the_form(cluster, launcher):
    cluster.ready()
    job = make_job(pk=None)
    assert job.pk is None
    assert launcher.preflight(job) == []


def test_it_says_when_the_api_server_is_unreachable(cluster, launcher):
    cluster.srv.stop()
    t0 = time.monotonic()
    (problem,) = launcher.preflight(make_job())
    assert "cannot reach the Kubernetes API server" in problem and "KUBECONFIG" in problem
    assert time.monotonic() - t0 < 15


def test_it_says_when_no_cluster_is_configured(tmp_path):
    launcher = KubernetesLauncher(kubeconfig=str(tmp_path / "missing"))
    (problem,) = launcher.preflight(make_job())
    assert "no usable Kubernetes configuration" in problem


def test_it_says_when_the_namespace_is_missing(cluster, launcher):
    (problem,) = launcher.preflight(make_job())
    assert "namespace 'train' does not exist" in problem and "kubectl create namespace train" in problem


def test_it_says_when_the_checkpoint_claim_is_missing(cluster, launcher):
    cluster.add_namespace()
    cluster.add_node("n0")
    (problem,) = launcher.preflight(make_job())
    assert "checkpoint claim 'fsx-checkpoints' does not exist" in problem and "ReadWriteMany" in problem


def test_it_refuses_a_claim_that_several_nodes_cannot_share(cluster, launcher):
    cluster.add_namespace()
    cluster.add_node("n0")
    cluster.add_pvc(modes=("ReadWriteOnce",))
    (problem,) = launcher.preflight(make_job(nodes=2))
    assert "must be ReadWriteMany" in problem
    assert launcher.preflight(make_job(nodes=1)) == []


def test_it_says_when_the_claims_storage_class_does_not_exist(cluster, launcher):
    cluster.add_namespace()
    cluster.add_node("n0")
    cluster.add_pvc(phase="Pending", storage_class="fsx-missing")
    (problem,) = launcher.preflight(make_job())
    assert "storage class 'fsx-missing'" in problem


def test_it_checks_the_gpus_per_node_against_the_largest_node(cluster, launcher):
    cluster.ready(gpus=4)
    (problem,) = launcher.preflight(make_job())
    assert "asks for 8 nvidia.com/gpu but the largest node has 4" in problem and "gpus_per_node" in problem
    assert launcher.preflight(make_job(kubernetes={"gpus_per_node": 4})) == []


def test_it_checks_efa_and_hints_at_the_device_plugin(cluster, launcher):
    cluster.add_namespace()
    cluster.add_pvc()
    cluster.add_node("n0", efa=0)
    (problem,) = launcher.preflight(make_job())
    assert "vpc.amazonaws.com/efa" in problem and "efa_per_node to 0" in problem


def test_it_only_counts_nodes_matching_the_node_selector(cluster, launcher):
    cluster.ready()
    cluster.add_node("small", gpus=1, labels={"node-type": "g5"})
    (problem,) = launcher.preflight(make_job(kubernetes={"node_selector": {"node-type": "g5"}}))
    assert "matching node_selector {'node-type': 'g5'} has 1" in problem
    (problem,) = launcher.preflight(make_job(kubernetes={"node_selector": {"node-type": "trn1"}}))
    assert "no node matching node_selector" in problem


@pytest.mark.parametrize("version,no_progress,ok", [("0.4.1", 2, False), ("0.6.0", 2, True), ("0.4.1", 0, True)])
def test_it_refuses_an_nvrx_option_the_images_release_lacks(cluster, launcher, version, no_progress, ok):
    cluster.ready()
    problems = launcher.preflight(make_job(in_process=True, max_no_progress_restarts=no_progress,
                                           kubernetes={"nvrx_version": version}))
    assert (problems == []) is ok
    if not ok:
        assert "max_no_progress_restarts" in problems[0] and "0.6.0" in problems[0] and version in problems[0]


def test_it_says_when_jobset_is_not_installed(cluster, launcher):
    cluster.ready()
    cluster.emu.jobset_installed = False
    (problem,) = launcher.preflight(make_job(kubernetes={"use_jobset": True}))
    assert "JobSet" in problem and "use_jobset off" in problem
    assert launcher.preflight(make_job()) == []


def test_it_reads_the_cluster_from_a_kubeconfig_file(cluster, tmp_path):
    cluster.ready()
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(f"""
apiVersion: v1
kind: Config
clusters: [{{name: fake, cluster: {{server: "{cluster.srv.url}"}}}}]
users: [{{name: test, user: {{token: not-checked}}}}]
contexts: [{{name: fake, context: {{cluster: fake, user: test}}}}]
current-context: fake
""")
    launcher = KubernetesLauncher(kubeconfig=str(kubeconfig))
    assert launcher.preflight(make_job()) == []
    launcher.launch(make_job(), token="t")
    assert cluster.get("jobs", "unbroken-7") is not None


def test_it_builds_the_launcher_from_settings(settings):
    settings.KUBECONFIG = "/nowhere/kubeconfig"
    settings.UNBROKEN_K8S_INGEST_URL = "http://unbroken-web.unbroken.svc.cluster.local:8000"
    from controlplane.launchers.backends import get_launcher
    launcher = get_launcher("kubernetes")
    assert (launcher.kubeconfig, launcher.ingest_url) == ("/nowhere/kubeconfig", settings.UNBROKEN_K8S_INGEST_URL)
    assert "no usable Kubernetes configuration" in launcher.preflight(make_job())[0]
