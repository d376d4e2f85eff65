"""The trainer argv (command.py), shared by the local and Kubernetes launchers, and the NVRx version check."""

import pytest
from k8shelpers import k8s_spec

from controlplane.jobs.spec import Drill, JobSpec
from controlplane.launchers import manifests
from controlplane.launchers.command import launch_args, nvrx_problems, trainer_args


def test_it_builds_the_exact_argv():
    spec = JobSpec(nodes=1, procs_per_node=4, preset="small", steps=500, checkpoint_interval=25,
                   checkpoint_mode="sync", keep_checkpoints=2, max_in_process_restarts=7, max_in_job_restarts=4,
                   heartbeat_interval_s=0.5, drills=(Drill(step=60, fault="exception", rank=1),
                                                     Drill(step=150, fault="sigkill", rank=0)))
    argv = launch_args(spec, node_rank=0, rdzv_endpoint="127.0.0.1:29400", run_dir="/runs/9", job_id=9,
                       attempt=2, report_url="http://cp:8000")
    assert argv == [
        "--nnodes", "1", "--node-rank", "0", "--nproc-per-node", "4", "--rdzv-endpoint", "127.0.0.1:29400",
        "--max-restarts", "4", "--in-job", "--run-dir", "/runs/9", "--job-id", "9", "--attempt", "2", "--",
        "--preset", "small", "--in-process", "--steps", "500", "--ckpt-interval", "25", "--ckpt-mode", "sync",
        "--keep-ckpts", "2", "--step-timeout", "30", "--ckpt-timeout", "300", "--startup-timeout", "120",
        "--max-in-process-restarts", "7", "--report-interval", "0.5",
        "--drill", "60:exception:1", "--drill", "150:sigkill:0", "--report-url", "http://cp:8000",
    ]


def test_it_turns_layers_off_explicitly():
    spec = JobSpec(in_process=False, in_job=False, max_in_job_restarts=4)
    argv = launch_args(spec, node_rank=0, rdzv_endpoint="h:1", run_dir="/r", job_id=1, attempt=0)
    assert "--no-in-job" in argv and "--no-in-process" in argv
    assert argv[argv.index("--max-restarts") + 1] == "0"
    assert "--max-in-process-restarts" not in argv
    assert "--report-url" not in trainer_args(spec)


def test_the_pod_argv_parses_with_the_trainers_own_launcher():
    """What the kubelet runs, after it expands $(JOB_COMPLETION_INDEX) and $(UNBROKEN_REPORT_URL)."""
    launch = pytest.importorskip("trainer.launch")
    spec = k8s_spec(nodes=16, drills=[{"step": 50, "fault": "sigkill", "rank": 100}])
    args = [a.replace("$(JOB_COMPLETION_INDEX)", "15").replace("$(UNBROKEN_REPORT_URL)", "http://cp:8000")
            for a in manifests.container_args(spec, job_id=42, attempt=1)]
    ns, _, cfg = launch.parse(args)
    assert (ns.nnodes, ns.node_rank, ns.nproc_per_node) == (16, 15, 8)
    assert ns.rdzv_host == "unbroken-42-0.unbroken-42.train.svc"
    assert (cfg.job_id, cfg.attempt, cfg.run_dir) == ("42", 1, "/checkpoints/unbroken-42")
    assert cfg.report_url == "http://cp:8000"
    assert [d.key for d in cfg.drills] == ["50:sigkill:100"]
    # The node-local checkpoint copies: in the node's shared memory (the pod mounts it), per job run.
    assert cfg.local_ckpt_dir.startswith("/dev/shm/unbroken/42-") and cfg.local_ckpt_dir.endswith("-a1")
    mounts = {m["mountPath"] for c in manifests.pod_template(spec, job_id=42, attempt=1)["spec"]["containers"]
              for m in c["volumeMounts"]}
    assert "/dev/shm" in mounts


def test_the_node_local_copy_is_asked_for_only_for_async_checkpoints_and_can_be_turned_off():
    def asked(spec):
        return "--local-ckpt-dir" in trainer_args(spec)

    assert asked(JobSpec()) and asked(JobSpec(entrypoint="train.py"))
    assert not asked(JobSpec(checkpoint_mode="sync"))
    assert not asked(JobSpec(local_checkpoint_copy=False))


def _argv(spec: JobSpec) -> list[str]:
    return launch_args(spec, node_rank=0, rdzv_endpoint="h:1", run_dir="/r", job_id=7, attempt=0,
                       report_url="http://cp")


def test_a_job_of_several_nodes_runs_a_node_agent_unless_told_not_to():
    assert k8s_spec(nodes=4).node_agent is True
    assert "--node-agent" in _argv(k8s_spec(nodes=4))
    assert "--node-agent" not in _argv(k8s_spec(nodes=4, node_agent=False))


def test_a_one_node_job_posts_directly_unless_asked():
    assert "--node-agent" not in _argv(JobSpec.from_dict({}))
    assert "--node-agent" not in _argv(k8s_spec(nodes=1))
    assert "--node-agent" in _argv(JobSpec.from_dict({"node_agent": True}))


def test_a_stored_spec_keeps_the_node_agent_choice_it_was_launched_with():
    stored = k8s_spec(nodes=2, node_agent=False).to_dict()
    assert JobSpec.from_dict(stored).node_agent is False


def test_ranks_are_fresh_processes_unless_the_spec_asks_for_warm_ones():
    assert "--fork-ranks" not in _argv(JobSpec.from_dict({}))
    assert "--fork-ranks" in _argv(JobSpec.from_dict({"fork_ranks": True}))
    assert "--fork-ranks" not in _argv(JobSpec.from_dict({"fork_ranks": True, "in_job": False}))  # torchrun then


@pytest.mark.parametrize("version,no_progress,expected", [
    ("", 2, []),  # not declared: not checked
    ("0.4.1", 0, []),
    ("0.6.0", 2, []),
    ("v0.7.1rc1", 2, []),
    ("0.4.1", 2, ["max_no_progress_restarts: needs NVRx 0.6.0 or later", "this job's NVRx is 0.4.1"]),
    ("0.5.2", 1, ["needs NVRx 0.6.0 or later", "this job's NVRx is 0.5.2"]),
    ("0.3.0", 0, ["nvrx_version: the trainer needs NVRx 0.4.1 or later"]),
    ("latest", 0, ["not a version"]),
])
def test_it_checks_the_jobs_nvrx_options_against_the_nvrx_version(version, no_progress, expected):
    (problem,) = nvrx_problems(JobSpec(max_no_progress_restarts=no_progress), version) or [""]
    for want in expected:
        assert want in problem
    assert bool(problem) is bool(expected)


def test_it_passes_the_no_progress_limit_to_the_launcher_only_when_set():
    assert "--max-no-progress-restarts" not in launch_args(JobSpec(), node_rank=0, rdzv_endpoint="h:1",
                                                           run_dir="/r", job_id=1, attempt=0)
    args = launch_args(JobSpec(max_no_progress_restarts=3), node_rank=0, rdzv_endpoint="h:1", run_dir="/r",
                       job_id=1, attempt=0)
    assert args[args.index("--max-no-progress-restarts") + 1] == "3"
