"""Launch options with a default that depends on the job: the node agent (on where a job spans nodes, off
on one node; an explicit choice wins) and warm ranks forked from a fork server (off unless asked)."""

from controlplane.jobs.spec import JobSpec
from controlplane.launchers.command import launch_args


def k8s_spec(**overrides) -> JobSpec:
    k8s = {"namespace": "train", "image": "registry.example/trainer:1", "nvrx_version": "0.4.1"}
    return JobSpec.from_dict({"backend": "kubernetes", "nodes": 2, "procs_per_node": 8, "kubernetes": k8s,
                              **overrides})


def _args(spec: JobSpec) -> list[str]:
    return launch_args(spec, node_rank=0, rdzv_endpoint="h:1", run_dir="/r", job_id=7, attempt=0,
                       report_url="http://cp")


def test_a_job_of_several_nodes_runs_a_node_agent_unless_told_not_to():
    assert k8s_spec(nodes=4).node_agent is True
    assert "--node-agent" in _args(k8s_spec(nodes=4))
    assert "--node-agent" not in _args(k8s_spec(nodes=4, node_agent=False))


def test_a_one_node_job_posts_directly_unless_asked():
    assert "--node-agent" not in _args(JobSpec.from_dict({}))
    assert "--node-agent" not in _args(k8s_spec(nodes=1))
    assert "--node-agent" in _args(JobSpec.from_dict({"node_agent": True}))


def test_a_stored_spec_keeps_what_it_was_launched_with():
    stored = k8s_spec(nodes=2, node_agent=False).to_dict()
    assert JobSpec.from_dict(stored).node_agent is False


def test_ranks_are_fresh_processes_unless_the_spec_asks_for_warm_ones():
    assert "--fork-ranks" not in _args(JobSpec.from_dict({}))
    assert "--fork-ranks" in _args(JobSpec.from_dict({"fork_ranks": True}))
    assert "--fork-ranks" not in _args(JobSpec.from_dict({"fork_ranks": True, "in_job": False}))  # torchrun then
