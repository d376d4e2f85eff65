"""The launcher's command line and environment, built from a JobSpec. Shared by every launcher (local
processes, pods).

Pure functions: same spec in, same argv out. The spec itself travels whole, as one JSON document in one
environment variable (``launch_env``: ``trainer.jobspec.ENV_SPEC``) that ``trainer.launch`` and each rank
decode with the same type; the argv (``launch_args``) carries only what the spec cannot know: the node's
rank, the rendezvous endpoint, the run directory, the job's identity and attempt, the ingest URL, and
(Kubernetes) the container's working directory.
"""

from __future__ import annotations

from controlplane.jobs.spec import JobSpec
from trainer import nvrx_compat
from trainer.jobspec import ENV_SPEC, LOCAL_CHECKPOINT_ROOT

TRAINER_LAUNCH = ("python", "-m", "trainer.launch")
RDZV_PORT = 29500

__all__ = [
    "LOCAL_CHECKPOINT_ROOT",
    "RDZV_PORT",
    "TRAINER_LAUNCH",
    "launch_args",
    "launch_env",
    "nvrx_problems",
]


def launch_env(spec: JobSpec) -> dict[str, str]:
    """The environment variable that hands the launcher (and through it every rank) the whole spec."""
    return {ENV_SPEC: spec.encode()}


def launch_args(
    spec: JobSpec,
    *,
    node_rank: int | str,
    rdzv_endpoint: str,
    run_dir: str,
    job_id: int | str,
    attempt: int,
    report_url: str = "",
    working_dir: str = "",
) -> list[str]:
    """Arguments of ``python -m trainer.launch`` for one node (the settings come from ``launch_env``).

    ``node_rank`` is a number, or a reference the runtime expands (Kubernetes: ``$(JOB_COMPLETION_INDEX)``).
    ``working_dir`` overrides the spec's (the local launcher runs the user's code in this tree by default).
    """
    return [
        "--node-rank",
        str(node_rank),
        "--rdzv-endpoint",
        rdzv_endpoint,
        "--run-dir",
        run_dir,
        "--job-id",
        str(job_id),
        "--attempt",
        str(attempt),
        *(["--report-url", report_url] if report_url else []),
        *(["--workdir", working_dir] if spec.entrypoint and working_dir else []),
    ]


def nvrx_problems(spec: JobSpec, nvrx_version: str) -> list[str]:
    """Why the job's NVRx options will not work with the trainer's NVRx release (``nvrx_version``: the
    image's for Kubernetes, the installed one for local jobs); each names the option and both versions.
    The rules are the trainer's own (trainer.nvrx_compat), so both sides refuse the same things."""
    problems = nvrx_compat.spec_problems(nvrx_version, max_no_progress_restarts=spec.max_no_progress_restarts)
    return [f"{name}: {message}" for name, message in problems.items()]
