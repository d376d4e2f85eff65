"""KubernetesLauncher.poll: the test plays the controllers (Job controller, scheduler, kubelet, node
lifecycle) and moves pods through their phases; poll turns what it sees into a PollResult with faults."""

import pytest

from trainer.wire import FaultClass

from k8shelpers import NS, make_job


@pytest.fixture()
def pods(cluster, launcher):
    launcher.launch(make_job(), token="t")
    return cluster.start_pods()


def poll(launcher, **kw):
    return launcher.poll(make_job(**kw))


def test_it_reports_pending_until_every_pod_runs_then_running_then_succeeded(cluster, launcher, pods):
    p0, p1 = pods
    assert poll(launcher).state == "pending"
    cluster.run(p0, "ip-10-0-0-0")
    assert poll(launcher).state == "pending"
    cluster.run(p1, "ip-10-0-0-1")
    result = poll(launcher)
    assert (result.state, result.faults) == ("running", [])
    cluster.terminate(p0, exit_code=0, reason="Completed")
    assert poll(launcher).state == "running"  # node 1 still training
    cluster.terminate(p1, exit_code=0, reason="Completed")
    assert poll(launcher).state == "succeeded"


def test_it_reports_success_from_the_job_condition(cluster, launcher, pods):
    cluster.complete_job()
    assert poll(launcher).state == "succeeded"


def test_it_reports_a_suspended_job_as_launching(cluster, launcher):
    from controlplane.launchers import manifests
    cluster.batch.create_namespaced_job(NS, manifests.workload(make_job().job_spec, job_id=7, attempt=0))
    result = poll(launcher)
    assert result.state == "pending" and "launching" in result.reason


def test_it_reports_oom_killed_with_the_node_and_ranks(cluster, launcher, pods):
    p0, p1 = pods
    cluster.run(p0, "ip-10-0-0-0")
    cluster.run(p1, "ip-10-0-0-1")
    cluster.terminate(p1, exit_code=137, reason="OOMKilled")
    result = poll(launcher)
    assert result.state == "failed"
    (fault,) = result.faults
    assert fault.fault_class == FaultClass.OOM_KILLED
    assert fault.node == "ip-10-0-0-1"
    assert "node rank 1, ranks 8-15" in fault.message and "OOMKilled" in fault.message
    assert fault.at is not None
    head, detail = fault.message.split("\n\n")
    assert result.reason == head
    assert detail == "container trainer terminated: reason OOMKilled, exit code 137"


def test_it_reports_an_exit_code_as_process_killed_with_the_log_tail(cluster, launcher, pods):
    p0, p1 = pods
    cluster.run(p0)
    cluster.terminate(p1, exit_code=1, message="Traceback ...\nRuntimeError: ft_launcher gave up after 5 restarts")
    (fault,) = poll(launcher).faults
    assert fault.fault_class == FaultClass.PROCESS_KILLED
    assert "exit code 1: RuntimeError: ft_launcher gave up after 5 restarts" in fault.message


def test_it_names_the_signal_of_a_killed_trainer(cluster, launcher, pods):
    cluster.terminate(pods[0], exit_code=143)
    (fault,) = poll(launcher).faults
    assert "exit code 143 (SIGTERM)" in fault.message


def test_it_reports_an_eviction(cluster, launcher, pods):
    cluster.run(pods[0])
    cluster.evict(pods[1])
    result = poll(launcher)
    assert result.state == "failed"
    assert [f.fault_class for f in result.faults] == [FaultClass.EVICTED]
    assert "low on resource: memory" in result.faults[0].message


def test_it_reports_a_lost_node(cluster, launcher, pods):
    cluster.run(pods[0], "ip-10-0-0-0")
    cluster.run(pods[1], "ip-10-0-0-1")
    cluster.lose_node(pods[1])
    (fault,) = poll(launcher).faults
    assert fault.fault_class == FaultClass.NODE_LOST
    assert fault.node == "ip-10-0-0-1" and "NoExecute" in fault.message


def test_it_reports_a_pod_deleted_while_running_as_node_lost(cluster, launcher, pods):
    cluster.run(pods[0])
    cluster.run(pods[1])
    cluster.emu.hold_deletions = True  # the kubelet is still stopping it: deletionTimestamp set
    cluster.core.delete_namespaced_pod(pods[1], NS)
    result = poll(launcher)
    assert result.state == "failed"
    assert [f.fault_class for f in result.faults] == [FaultClass.NODE_LOST]
    assert "deleted while running" in result.faults[0].message


def test_it_reports_a_pod_that_vanished_when_the_job_failed(cluster, launcher, pods):
    cluster.run(pods[0])
    cluster.core.delete_namespaced_pod(pods[1], NS)  # node removed: the pod GC deleted it
    assert poll(launcher).state == "pending"  # one of two pods: not yet conclusive
    cluster.fail_job()
    result = poll(launcher)
    assert result.state == "failed"
    assert [(f.fault_class, "node rank 1" in f.message) for f in result.faults] == [(FaultClass.NODE_LOST, True)]


def test_it_reports_unschedulable_pods_as_pending_with_a_fault(cluster, launcher, pods):
    cluster.unschedulable(pods[0])
    cluster.unschedulable(pods[1])
    result = poll(launcher)
    assert result.state == "pending"
    assert [f.fault_class for f in result.faults] == [FaultClass.UNSCHEDULABLE] * 2
    assert "Insufficient nvidia.com/gpu" in result.reason


def test_it_reports_image_pull_failures(cluster, launcher, pods):
    cluster.run(pods[0])
    cluster.image_pull_backoff(pods[1])
    result = poll(launcher)
    assert result.state == "pending"
    (fault,) = result.faults
    assert fault.fault_class == FaultClass.IMAGE_PULL and "Back-off pulling image" in fault.message


def test_it_uses_events_to_explain_pods_that_do_not_appear(cluster, launcher):
    launcher.launch(make_job(), token="t")
    cluster.warn("unbroken-7", "FailedCreate", 'pods "unbroken-7-0" is forbidden: exceeded quota: gpu-quota',
                 kind="Job")
    cluster.warn("someone-else", "FailedCreate", "not ours", kind="Job")
    result = poll(launcher)
    assert result.state == "pending"
    assert "0 of 2 created" in result.reason and "exceeded quota" in result.reason and "not ours" not in result.reason


def test_it_turns_a_failed_scheduling_event_into_an_unschedulable_fault(cluster, launcher, pods):
    cluster.warn(pods[0], "FailedScheduling", "0/3 nodes are available: 3 node(s) didn't match node selector.")
    result = poll(launcher)
    assert [f.fault_class for f in result.faults] == [FaultClass.UNSCHEDULABLE]
    assert "didn't match node selector" in result.faults[0].message


def test_it_gives_each_fault_a_stable_key_so_repeated_polls_record_it_once(cluster, launcher, pods):
    cluster.terminate(pods[0], exit_code=137, reason="OOMKilled")
    assert [f.source_key for f in poll(launcher).faults] == [f.source_key for f in poll(launcher).faults]


def test_it_reports_a_deleted_job_as_lost(cluster, launcher, pods):
    cluster.batch.delete_namespaced_job("unbroken-7", NS)
    result = poll(launcher)
    assert result.state == "lost" and "unbroken-7" in result.reason


def test_it_ignores_pods_of_the_previous_attempt(cluster, launcher, pods):
    cluster.terminate(pods[0], exit_code=1)  # attempt 0 failed ...
    launcher.stop(make_job(), grace_s=0)
    launcher.launch(make_job(attempt=1), token="t")  # ... attempt 1 starts clean
    new = cluster.start_pods()
    cluster.run(new[0])
    cluster.run(new[1])
    assert poll(launcher, attempt=1).state == "running"


def test_it_reports_pending_while_the_job_is_being_deleted(cluster, launcher, pods):
    cluster.emu.hold_deletions = True
    cluster.batch.delete_namespaced_job("unbroken-7", NS, propagation_policy="Foreground")
    cluster.terminate(pods[0], exit_code=143)
    result = poll(launcher)
    assert (result.state, result.faults) == ("pending", [])  # a stop in progress is not a fault


def test_it_polls_a_jobset_by_its_pods(cluster, launcher):
    job = make_job(kubernetes={"use_jobset": True})
    launcher.launch(job, token="t")
    assert launcher.poll(job).state == "pending"
    # Play the JobSet and Job controllers: Job unbroken-7-node-0, one pod per completion index.
    tmpl = cluster.get("jobsets", "unbroken-7")["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    for i in range(2):
        meta = {**tmpl["metadata"], "name": f"unbroken-7-node-0-{i}-x",
                "annotations": {"batch.kubernetes.io/job-completion-index": str(i)}}
        cluster.core.create_namespaced_pod(NS, {"metadata": meta, "spec": tmpl["spec"]})
        cluster.run(meta["name"])
    assert launcher.poll(job).state == "running"
    cluster.terminate("unbroken-7-node-0-1-x", exit_code=137, reason="OOMKilled")
    assert [f.fault_class for f in launcher.poll(job).faults] == [FaultClass.OOM_KILLED]


def test_it_reports_only_the_cause_not_the_pods_the_job_controller_then_deleted(cluster, launcher, pods):
    cluster.run(pods[0], "ip-10-0-0-0")
    cluster.run(pods[1], "ip-10-0-0-1")
    cluster.terminate(pods[1], exit_code=137, reason="OOMKilled")
    cluster.fail_job()
    # The Job controller deletes node 0's pod; it exits 143. (The fake drops a terminating pod whose status
    # is patched, so the exit status is set first: the pod must still be there, terminating, when polled.)
    cluster.terminate(pods[0], exit_code=143)
    cluster.emu.hold_deletions = True
    cluster.core.delete_namespaced_pod(pods[0], NS)
    assert cluster.get("pods", pods[0])["metadata"]["deletionTimestamp"]
    result = launcher.poll(make_job())
    assert result.state == "failed"
    assert [f.fault_class for f in result.faults] == [FaultClass.OOM_KILLED]
    assert "OOMKilled" in result.reason
