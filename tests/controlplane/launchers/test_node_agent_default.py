"""The node agent is on by default where a job spans nodes (one request per node instead of one per rank),
off on one node, and an explicit choice always wins."""

from controlplane.jobs.spec import JobSpec
from controlplane.launchers.command import launch_args
from tests.controlplane.launchers.k8s.k8shelpers import k8s_spec


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
