"""The job page's "Code" facts for a job that runs the user's own script: what was run, the integration
level its ranks reported, their versions, and what that level cannot show."""

from __future__ import annotations

import shlex

from controlplane.jobs import readouts
from controlplane.jobs.models import Job

# What each integration level of the user's own code cannot tell the control plane (shown, not zeros).
LEVEL_LIMITS = {
    0: "Level 0 (unmodified script): process facts only - starts, exits, signals, restarts, tracebacks, and "
       "steps and loss where the script prints them. No phases, no checkpoint ledger, no checkpoint-load "
       "mark; a hang is seen only as the printed step standing still, and ended after the stall timeout. "
       "Add the SDK's few lines for more.",
    1: "Level 1 (SDK calls): steps, loss, phases, commands and hang detection from the loop's heartbeats. "
       "Your script saves its own checkpoints, so there is no checkpoint ledger or checkpoint-load mark, "
       "and no in-process restart.",
    2: "Level 2 (SDK entrypoint): steps, loss, phases, commands agreed across ranks, the product's async "
       "checkpoints with their ledger, and in-process restarts when the job has them on.",
}


def code_part(job: Job) -> dict | None:
    """What the job runs when it is the user's own code: entrypoint, arguments, environment names, the
    integration level its ranks reported and the versions they run with. None for the built-in model."""
    spec = job.job_spec
    if not spec.entrypoint:
        return None
    reported = readouts.integration(job)
    level = reported.level if reported else None
    limits = LEVEL_LIMITS.get(level) if level is not None else \
        "waiting for the ranks to start (they report their integration level and versions)"
    if level is not None and level < 2 and spec.in_process:
        limits += " In-process restarts are on for this job but take effect only at level 2."
    return {
        "entrypoint": spec.entrypoint,
        "args": shlex.join(spec.args),
        "working_dir": spec.working_dir,
        "env_names": sorted(spec.env),
        "level": level,
        "versions": reported.versions if reported else {},
        "limits": limits,
    }
