"""KubernetesLauncher.launch / stop / log_tail against the loopback API server (strict schemas, 422)."""

import base64
import json
import urllib.error
import urllib.request

import pytest

from controlplane.jobs.models import JobStatus
from controlplane.launchers import manifests
from controlplane.launchers.base import LaunchError, TransientLaunchError

from k8shelpers import INGEST_URL, NS, make_job


def test_it_creates_job_service_and_secret_owned_by_the_job(cluster, launcher):
    state = launcher.launch(make_job(), token="ubk_secret")
    job = cluster.get("jobs", "unbroken-7")
    assert job["spec"]["suspend"] is False  # unsuspended after its Secret and Service exist
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["parallelism"] == 2
    uid = job["metadata"]["uid"]
    for plural, name in (("services", "unbroken-7"), ("secrets", "unbroken-7-token")):
        obj = cluster.get(plural, name)
        assert [(o["kind"], o["uid"]) for o in obj["metadata"]["ownerReferences"]] == [("Job", uid)]
    secret = cluster.get("secrets", "unbroken-7-token")
    assert base64.b64decode(secret["data"]["token"]).decode() == "ubk_secret"
    assert base64.b64decode(secret["data"]["report-url"]).decode() == INGEST_URL
    assert "ubk_secret" not in json.dumps(job)
    assert state == {"namespace": NS, "kind": "Job", "name": "unbroken-7", "uid": uid, "attempt": 0,
                     "secret": "unbroken-7-token", "service": "unbroken-7",
                     "rdzv_endpoint": "unbroken-7-0.unbroken-7.train.svc:29500"}
    # Job first (suspended), then Service and Secret, then the unsuspend patch.
    posts = [r[1].rsplit("/", 1)[-1] for r in cluster.requests("POST")]
    assert posts == ["jobs", "services", "secrets"]
    assert cluster.requests("PATCH", "/jobs/unbroken-7")[-1][3] == {"spec": {"suspend": False}}


def test_it_asks_for_strict_field_validation(cluster, launcher):
    launcher.launch(make_job(), token="t")
    assert cluster.requests("POST", "/jobs")[0][2].get("fieldValidation") == "Strict"


def test_it_treats_a_retried_launch_of_the_same_attempt_as_done(cluster, launcher):
    first = launcher.launch(make_job(), token="t1")
    again = launcher.launch(make_job(), token="t2")  # the task retried after a lost answer
    assert again["uid"] == first["uid"]
    assert len(cluster.objects("jobs")) == 1
    secret = cluster.get("secrets", "unbroken-7-token")
    assert base64.b64decode(secret["data"]["token"]).decode() == "t2"  # the token of the latest launch wins


def test_it_replaces_a_leftover_previous_attempt(cluster, launcher):
    old = launcher.launch(make_job(attempt=0), token="t")
    new = launcher.launch(make_job(attempt=1), token="t")
    assert new["uid"] != old["uid"]
    job = cluster.get("jobs", "unbroken-7")
    assert job["metadata"]["labels"][manifests.L_ATTEMPT] == "1"
    assert "--attempt" in (args := job["spec"]["template"]["spec"]["containers"][0]["args"])
    assert args[args.index("--attempt") + 1] == "1"
    svc = cluster.get("services", "unbroken-7")
    assert svc["spec"]["selector"][manifests.L_ATTEMPT] == "1"


def test_it_retries_while_the_previous_attempt_is_still_terminating(cluster, launcher):
    launcher.launch(make_job(attempt=0), token="t")
    cluster.emu.hold_deletions = True
    with pytest.raises(TransientLaunchError, match="still being deleted"):
        launcher.launch(make_job(attempt=1), token="t")
    cluster.emu.hold_deletions = False
    cluster.emu.release_deletions()
    launcher.launch(make_job(attempt=1), token="t")
    assert cluster.get("jobs", "unbroken-7")["metadata"]["labels"][manifests.L_ATTEMPT] == "1"


def test_it_launches_a_jobset_when_asked(cluster, launcher):
    state = launcher.launch(make_job(kubernetes={"use_jobset": True}), token="t")
    js = cluster.get("jobsets", "unbroken-7")
    assert js["spec"]["suspend"] is False
    assert state["kind"] == "JobSet"
    assert state["rdzv_endpoint"] == "unbroken-7-node-0-0.unbroken-7.train.svc:29500"
    assert cluster.objects("services") == {}  # the JobSet controller makes the headless Service
    owner = cluster.get("secrets", "unbroken-7-token")["metadata"]["ownerReferences"][0]
    assert (owner["apiVersion"], owner["kind"], owner["uid"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet",
                                                                   js["metadata"]["uid"])


@pytest.mark.parametrize("status", [429, 500, 503, 504])
def test_it_raises_transient_errors_for_throttling_and_server_errors(cluster, launcher, status):
    cluster.emu.fail_next("POST", "/jobs", status)
    with pytest.raises(TransientLaunchError, match=str(status)):
        launcher.launch(make_job(), token="t")
    launcher.launch(make_job(), token="t")  # the retry goes through
    assert cluster.get("jobs", "unbroken-7")["spec"]["suspend"] is False


def test_it_raises_transient_when_the_api_server_is_unreachable(cluster, launcher):
    cluster.srv.stop()
    with pytest.raises(TransientLaunchError, match="did not answer"):
        launcher.launch(make_job(), token="t")


def test_it_turns_forbidden_into_a_launch_error_naming_the_role(cluster, launcher):
    cluster.emu.fail_next("POST", "/secrets", 403)
    with pytest.raises(LaunchError, match="rbac.yaml"):
        launcher.launch(make_job(), token="t")


def test_it_turns_an_invalid_object_into_a_launch_error(cluster, launcher):
    cluster.emu.fail_next("POST", "/jobs", 422)
    with pytest.raises(LaunchError, match="refused"):
        launcher.launch(make_job(), token="t")


def test_it_refuses_a_manifest_the_client_cannot_send(cluster, launcher):
    job = make_job(kubernetes={"tolerations": [{"key": "x", "operatorr": "Exists"}]})
    with pytest.raises(LaunchError, match="tolerations"):
        launcher.launch(job, token="t")
    assert cluster.objects("jobs") == {}


def test_the_fake_answers_422_for_an_invalid_job(cluster):
    bad = manifests.workload(make_job().job_spec, job_id=7, attempt=0)
    bad["spec"]["template"]["spec"]["containers"][0]["imagee"] = "typo"
    req = urllib.request.Request(f"{cluster.srv.url}/apis/batch/v1/namespaces/{NS}/jobs", method="POST",
                                 data=json.dumps(bad).encode(), headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 422
    assert "imagee" in e.value.read().decode()


def test_it_stops_with_foreground_deletion_and_leaves_nothing(cluster, launcher):
    launcher.launch(make_job(), token="t")
    cluster.start_pods()
    launcher.stop(make_job(), grace_s=5)
    for plural in ("jobs", "pods", "services", "secrets"):
        assert cluster.objects(plural) == {}, plural
    delete = cluster.requests("DELETE", "/jobs/unbroken-7")[0]
    assert (delete[2].get("propagationPolicy") or (delete[3] or {}).get("propagationPolicy")) == "Foreground"
    pod_deletes = cluster.requests("DELETE", "/pods/")
    assert all((r[2].get("gracePeriodSeconds") or str((r[3] or {}).get("gracePeriodSeconds"))) == "5"
               for r in pod_deletes)


def test_it_stops_idempotently(cluster, launcher):
    launcher.stop(make_job(), grace_s=1)  # nothing there: fine
    launcher.launch(make_job(), token="t")
    launcher.stop(make_job(), grace_s=1)
    launcher.stop(make_job(), grace_s=1)
    assert cluster.objects("jobs") == {}


def test_it_keeps_the_token_secret_through_a_job_level_restart(cluster, launcher):
    launcher.launch(make_job(), token="ubk_once")
    recovering = make_job()
    recovering.status = JobStatus.RECOVERING
    launcher.stop(recovering, grace_s=1)
    assert cluster.objects("jobs") == {}
    assert not cluster.get("secrets", "unbroken-7-token")["metadata"].get("ownerReferences")
    launcher.launch(make_job(attempt=1), token=None)  # the lead's flow mints the token only once
    secret = cluster.get("secrets", "unbroken-7-token")
    assert base64.b64decode(secret["data"]["token"]).decode() == "ubk_once"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == cluster.get("jobs", "unbroken-7")["metadata"]["uid"]


def test_it_refuses_to_launch_without_a_token_when_the_secret_is_gone(cluster, launcher):
    with pytest.raises(LaunchError, match="token Secret"):
        launcher.launch(make_job(attempt=1), token=None)


def test_it_waits_for_terminating_pods_then_gives_up_with_a_transient_error(cluster, launcher):
    launcher.launch(make_job(), token="t")
    cluster.start_pods()
    cluster.emu.hold_deletions = True
    with pytest.raises(TransientLaunchError, match="still terminating"):
        launcher.stop(make_job(), grace_s=0)
    cluster.emu.hold_deletions = False
    cluster.emu.release_deletions()
    launcher.stop(make_job(), grace_s=0)  # the retried stop finds nothing left
    assert cluster.objects("pods") == {}


def test_it_tails_the_log_of_the_failed_pod(cluster, launcher):
    launcher.launch(make_job(), token="t")
    p0, p1 = cluster.start_pods()
    cluster.emu.logs[(NS, p0)] = "{\"json\": \"log line\"}\n"
    cluster.emu.logs[(NS, p1)] = "".join(f"line {i}\n" for i in range(100)) + "RuntimeError: boom\n"
    cluster.run(p0)
    cluster.terminate(p1, exit_code=1)
    tail = launcher.log_tail(make_job(), max_bytes=40)
    assert tail.endswith("RuntimeError: boom\n") and len(tail.encode()) <= 40
    assert launcher.log_tail(make_job(pk=8)) == ""


def test_it_returns_a_log_as_text_even_when_it_looks_like_json(cluster, launcher):
    launcher.launch(make_job(), token="t")
    p0, _ = cluster.start_pods()
    cluster.emu.logs[(NS, p0)] = '{"step": 1}\n'
    assert launcher.log_tail(make_job()) == '{"step": 1}\n'
