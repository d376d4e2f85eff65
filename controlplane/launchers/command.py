"""The trainer's command line, built from a JobSpec. Shared by every launcher (local processes, pods).

Pure functions: same spec in, same argv out. ``launch_args`` is what ``python -m trainer.launch`` takes
(the ft_launcher side: nodes, rendezvous, in-job restarts, identity); everything after ``--`` is
``trainer_args`` (the training loop: model, steps, checkpoints, in-process restarts, drills).
"""

from __future__ import annotations

import json

from controlplane.jobs.spec import JobSpec
from trainer import nvrx_compat

TRAINER_LAUNCH = ("python", "-m", "trainer.launch")
RDZV_PORT = 29500
#: The node's shared memory (a pod mounts the node's /dev/shm): each rank's copy of its newest async save.
LOCAL_CHECKPOINT_ROOT = "/dev/shm/unbroken"


def _num(x: float) -> str:
    """Seconds as the shortest exact text: 1.0 -> '1', 0.5 -> '0.5'."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def trainer_args(spec: JobSpec, *, report_url: str = "") -> list[str]:
    """Flags of the training loop (``python -m trainer`` parses them; ``trainer.launch`` passes them on).

    For the user's own code (``spec.entrypoint``) they are the shim's: reporting, drills, the layers'
    timeouts and the checkpoint settings the SDK's full level uses; the built-in model adds its preset."""
    args = [] if spec.entrypoint else ["--preset", spec.preset]
    # The deadlines ft_launcher and the ranks work to are the spec's, the same the control plane judges by,
    # for the built-in model as for the user's code.
    args += ["--in-process" if spec.in_process else "--no-in-process", "--steps", str(spec.steps),
             "--ckpt-interval", str(spec.checkpoint_interval), "--ckpt-mode", spec.checkpoint_mode,
             "--keep-ckpts", str(spec.keep_checkpoints),
             "--step-timeout", _num(spec.step_timeout_s),
             "--ckpt-timeout", _num(spec.checkpoint_timeout_s),
             "--startup-timeout", _num(spec.startup_timeout_s)]
    if spec.local_checkpoint_copy and spec.checkpoint_mode == "async":
        args += ["--local-ckpt-dir", LOCAL_CHECKPOINT_ROOT]
    if spec.in_process:
        args += ["--max-in-process-restarts", str(spec.max_in_process_restarts)]
    args += ["--report-interval", _num(spec.heartbeat_interval_s)]
    if spec.straggler_window_s != 5.0:  # the trainer's default
        args += ["--straggler-window", _num(spec.straggler_window_s)]
    for drill in spec.drills:
        args += ["--drill", drill.as_flag()]
    if report_url:
        args += ["--report-url", report_url]
    return args


def launch_args(spec: JobSpec, *, node_rank: int | str, rdzv_endpoint: str, run_dir: str, job_id: int | str,
                attempt: int, report_url: str = "", working_dir: str = "") -> list[str]:
    """Arguments of ``python -m trainer.launch`` for one node.

    ``node_rank`` is a number, or a reference the runtime expands (Kubernetes: ``$(JOB_COMPLETION_INDEX)``).
    ``--max-restarts`` is ft_launcher's in-job budget; with in-job restarts off it is 0 so that a
    failed rank ends the node at once and the control plane decides (job-level restart or fail).
    The user's own code adds ``--entrypoint``/``--workdir`` and its arguments after a second ``--``.
    """
    user: list[str] = []
    if spec.entrypoint:
        user = ["--entrypoint", spec.entrypoint]
        if working_dir or spec.working_dir:
            user += ["--workdir", working_dir or spec.working_dir]
    tail = ["--", *spec.args] if spec.entrypoint else []
    return [
        "--nnodes", str(spec.nodes),
        "--node-rank", str(node_rank),
        "--nproc-per-node", str(spec.procs_per_node),
        "--rdzv-endpoint", rdzv_endpoint,
        "--max-restarts", str(spec.max_in_job_restarts if spec.in_job else 0),
        "--in-job" if spec.in_job else "--no-in-job",
        *(["--max-no-progress-restarts", str(n)] if (n := spec.max_no_progress_restarts) else []),
        *(["--node-agent"] if spec.node_agent else []),
        *(["--fork-ranks"] if spec.fork_ranks and spec.in_job else []),
        *(["--failure-policy", json.dumps([r.to_dict() for r in spec.failure_policy], separators=(",", ":"))]
          if spec.failure_policy else []),
        "--run-dir", run_dir,
        "--job-id", str(job_id),
        "--attempt", str(attempt),
        *user,
        "--",
        *trainer_args(spec, report_url=report_url),
        *tail,
    ]


def nvrx_problems(spec: JobSpec, nvrx_version: str) -> list[str]:
    """Why the job's NVRx options will not work with the trainer's NVRx release (``nvrx_version``: the
    image's for Kubernetes, the installed one for local jobs); each names the option and both versions.
    The rules are the trainer's own (trainer.nvrx_compat), so both sides refuse the same things."""
    problems = nvrx_compat.spec_problems(nvrx_version, max_no_progress_restarts=spec.max_no_progress_restarts)
    return [f"{name}: {message}" for name, message in problems.items()]
