"""The launcher's argv and environment (command.py), shared by the local and Kubernetes launchers, and the NVRx version check."""

import pytest

from controlplane.jobs.spec import Drill, JobSpec
from controlplane.launchers import manifests
from controlplane.launchers.command import launch_args, launch_env, nvrx_problems
from trainer.jobspec import ENV_SPEC

from k8shelpers import k8s_spec

# One spec's settings and one place to launch it, shared by the exact-argv test and the round trip through
# ``trainer.launch`` so that both pin the same values.
SETTINGS = dict(
    procs_per_node=4,
    preset="small",
    steps=500,
    checkpoint_interval=25,
    checkpoint_mode="sync",
    keep_checkpoints=2,
    max_in_process_restarts=7,
    max_in_job_restarts=4,
    heartbeat_interval_s=0.5,
)
PLACE = dict(rdzv_endpoint="127.0.0.1:29400", run_dir="/runs/9", job_id=9, attempt=2)


def parsed(spec: JobSpec, monkeypatch, **kw):
    """What ``trainer.launch`` makes of the argv and environment the launchers give it for ``spec``."""
    launch = pytest.importorskip("trainer.launch")
    for k, v in launch_env(spec).items():
        monkeypatch.setenv(k, v)
    kw.setdefault("node_rank", 0)
    return launch.parse(launch_args(spec, **PLACE, **kw))


def test_it_builds_the_exact_argv():
    """The argv carries what the spec cannot know; the settings travel whole in one variable."""
    spec = JobSpec(
        nodes=1,
        drills=(Drill(step=60, fault="exception", rank=1), Drill(step=150, fault="sigkill", rank=0)),
        **SETTINGS,
    )
    argv = launch_args(spec, node_rank=0, report_url="http://cp:8000", **PLACE)
    assert argv == [
        "--node-rank",
        "0",
        "--rdzv-endpoint",
        "127.0.0.1:29400",
        "--run-dir",
        "/runs/9",
        "--job-id",
        "9",
        "--attempt",
        "2",
        "--report-url",
        "http://cp:8000",
    ]
    assert JobSpec.decode(launch_env(spec)[ENV_SPEC]) == spec


def test_the_launcher_takes_every_setting_from_the_spec(monkeypatch):
    spec = JobSpec(
        step_timeout_s=70,
        checkpoint_timeout_s=400,
        drills=(Drill(step=60, fault="exception", rank=1),),
        **SETTINGS,
    )
    ns, trainer_args, cfg = parsed(spec, monkeypatch, report_url="http://cp:8000")
    assert (ns.nnodes, ns.nproc_per_node, ns.max_restarts, ns.in_job) == (1, 4, 4, True)
    assert ns.user_args[:2] == ["--preset", "small"]  # the built-in model's own arguments
    assert (cfg.steps, cfg.ckpt_interval, cfg.ckpt_mode, cfg.keep_ckpts) == (500, 25, "sync", 2)
    assert (cfg.step_timeout, cfg.ckpt_timeout, cfg.startup_timeout) == (70, 400, 140)
    assert (cfg.max_in_process_restarts, cfg.report_interval, cfg.report_url) == (7, 0.5, "http://cp:8000")
    assert [d.key for d in cfg.drills] == ["60:exception:1"] and cfg.spec == spec
    assert "--steps" not in trainer_args  # the ranks decode the same spec


def test_it_turns_layers_off_explicitly(monkeypatch):
    spec = JobSpec(in_process=False, in_job=False, max_in_job_restarts=4)
    ns, _, cfg = parsed(spec, monkeypatch)
    assert (ns.in_job, ns.max_restarts, cfg.in_process) == (False, 0, False)
    assert cfg.report_url == ""


def test_a_flag_the_spec_sets_is_refused(monkeypatch):
    launch = pytest.importorskip("trainer.launch")
    monkeypatch.setenv(ENV_SPEC, JobSpec().encode())
    with pytest.raises(ValueError, match="the job's spec"):
        launch.parse(["--nproc-per-node", "3", "--run-dir", "/r"])
    with pytest.raises(ValueError, match="there are no trainer flags"):
        launch.parse(["--run-dir", "/r", "--", "--steps", "3"])


def test_the_pod_argv_parses_with_the_trainers_own_launcher(monkeypatch):
    """What the kubelet runs, after it expands $(JOB_COMPLETION_INDEX) and $(UNBROKEN_REPORT_URL)."""
    launch = pytest.importorskip("trainer.launch")
    spec = k8s_spec(nodes=16, drills=[{"step": 50, "fault": "sigkill", "rank": 100}])
    args = [
        a.replace("$(JOB_COMPLETION_INDEX)", "15").replace("$(UNBROKEN_REPORT_URL)", "http://cp:8000")
        for a in manifests.container_args(spec, job_id=42, attempt=1)
    ]
    (container,) = manifests.pod_template(spec, job_id=42, attempt=1)["spec"]["containers"]
    env = {e["name"]: e["value"].replace("$$", "$") for e in container["env"] if "value" in e}
    monkeypatch.setenv(ENV_SPEC, env[ENV_SPEC])
    monkeypatch.delenv("UNBROKEN_LOCAL_CKPT_DIR", raising=False)
    ns, _, cfg = launch.parse(args)
    assert (ns.nnodes, ns.node_rank, ns.nproc_per_node) == (16, 15, 8)
    assert ns.rdzv_host == "unbroken-42-0.unbroken-42.train.svc"
    assert (cfg.job_id, cfg.attempt, cfg.run_dir) == ("42", 1, "/checkpoints/unbroken-42")
    assert cfg.report_url == "http://cp:8000"
    assert [d.key for d in cfg.drills] == ["50:sigkill:100"]
    # The node-local checkpoint copies: in the node's shared memory (the pod mounts it), per job run.
    assert cfg.local_ckpt_dir.startswith("/dev/shm/unbroken/42-") and cfg.local_ckpt_dir.endswith("-a1")
    mounts = {
        m["mountPath"]
        for c in manifests.pod_template(spec, job_id=42, attempt=1)["spec"]["containers"]
        for m in c["volumeMounts"]
    }
    assert "/dev/shm" in mounts


def test_the_node_local_copy_is_asked_for_only_for_async_checkpoints_and_can_be_turned_off(monkeypatch):
    monkeypatch.delenv("UNBROKEN_LOCAL_CKPT_DIR", raising=False)

    def asked(spec):
        return bool(parsed(spec, monkeypatch)[2].local_ckpt_root)

    assert asked(JobSpec()) and asked(JobSpec(entrypoint="train.py"))
    assert not asked(JobSpec(checkpoint_mode="sync"))
    assert not asked(JobSpec(local_checkpoint_copy=False))


def test_a_job_of_several_nodes_runs_a_node_agent_unless_told_not_to(monkeypatch):
    assert k8s_spec(nodes=4).node_agent is True
    assert parsed(k8s_spec(nodes=4), monkeypatch)[0].node_agent
    assert not parsed(k8s_spec(nodes=4, node_agent=False), monkeypatch)[0].node_agent


def test_a_one_node_job_posts_directly_unless_asked(monkeypatch):
    assert not parsed(JobSpec.from_dict({}), monkeypatch)[0].node_agent
    assert not parsed(k8s_spec(nodes=1), monkeypatch)[0].node_agent
    assert parsed(JobSpec.from_dict({"node_agent": True}), monkeypatch)[0].node_agent


def test_a_stored_spec_keeps_the_node_agent_choice_it_was_launched_with():
    stored = k8s_spec(nodes=2, node_agent=False).to_dict()
    assert JobSpec.from_dict(stored).node_agent is False


def test_ranks_are_fresh_processes_unless_the_spec_asks_for_warm_ones(monkeypatch):
    assert not parsed(JobSpec.from_dict({}), monkeypatch)[0].fork_ranks
    assert parsed(JobSpec.from_dict({"fork_ranks": True}), monkeypatch)[0].fork_ranks
    assert not parsed(JobSpec.from_dict({"fork_ranks": True, "in_job": False}), monkeypatch)[0].fork_ranks


@pytest.mark.parametrize(
    "version,no_progress,expected",
    [
        ("", 2, []),  # not declared: not checked
        ("0.4.1", 0, []),
        ("0.6.0", 2, []),
        ("v0.7.1rc1", 2, []),
        ("0.4.1", 2, ["max_no_progress_restarts: needs NVRx 0.6.0 or later", "this job's NVRx is 0.4.1"]),
        ("0.5.2", 1, ["needs NVRx 0.6.0 or later", "this job's NVRx is 0.5.2"]),
        ("0.3.0", 0, ["nvrx_version: the trainer needs NVRx 0.4.1 or later"]),
        ("latest", 0, ["not a version"]),
    ],
)
def test_it_checks_the_jobs_nvrx_options_against_the_nvrx_version(version, no_progress, expected):
    (problem,) = nvrx_problems(JobSpec(max_no_progress_restarts=no_progress), version) or [""]
    for want in expected:
        assert want in problem
    assert bool(problem) is bool(expected)


def test_it_passes_the_no_progress_limit_to_the_launcher(monkeypatch):
    from trainer import nvrx_compat

    assert parsed(JobSpec(), monkeypatch)[0].max_no_progress_restarts == 0
    if nvrx_compat.spec_problems(nvrx_compat.version_str(), max_no_progress_restarts=3):
        with pytest.raises(ValueError, match="max-no-progress-restarts: needs NVRx 0.6.0"):
            parsed(JobSpec(max_no_progress_restarts=3), monkeypatch)
    else:
        assert parsed(JobSpec(max_no_progress_restarts=3), monkeypatch)[0].max_no_progress_restarts == 3
