"""What every launcher backend offers. Backends: ``local`` (processes here), ``kubernetes``.

A launcher starts and stops one job's processes or pods and reports what only it can see. It never
decides policy (restart or fail): ``controlplane.launchers.tasks`` does, from what ``poll`` returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from controlplane.jobs.models import Job


class LaunchError(Exception):
    """A launch that cannot succeed as asked (bad cluster, missing claim...). Shown to the user."""


class TransientLaunchError(Exception):
    """Worth retrying with backoff (API server 429/5xx/409, timeouts)."""


@dataclass(slots=True, frozen=True)
class LaunchFault:
    """A fault only the launcher sees (exit code, signal, pod reason)."""

    fault_class: str  # trainer.wire.FaultClass
    message: str
    source_key: str  # stable per occurrence, so a repeated poll records it once
    rank: int | None = None
    node: str = ""
    at: float | None = None  # unix seconds, when known


@dataclass(slots=True, frozen=True)
class PollResult:
    """``state`` is one of: running, succeeded, failed, lost, pending."""

    state: str
    reason: str = ""
    faults: list[LaunchFault] = field(default_factory=list)
    retryable: bool = True  # False: a failure that a job-level restart would only repeat


class Launcher(Protocol):
    name: str

    def preflight(self, job: Job) -> list[str]:
        """Problems that would make a launch fail, as messages for the form; empty when fine."""
        ...

    def launch(self, job: Job, *, token: str | None) -> dict:
        """Start attempt ``job.attempt``. Returns the launcher_state to store on the job.

        ``token`` is the job's new ingest token on the first launch (store it where the trainer
        reads it: a 0600 file, a Secret); ``None`` on later attempts: reuse what the first stored.
        """
        ...

    def stop(self, job: Job, *, grace_s: float) -> None:
        """Stop everything of this job; idempotent; returns when nothing is left."""
        ...

    def hold(self, job: Job) -> str:
        """Keep the job's processes or pods for debugging, without letting them train on (a failure
        policy's ``stop_keep``); ``stop`` releases them. Returns what was kept, in words."""
        ...

    def poll(self, job: Job) -> PollResult:
        """Where the job's processes or pods are now."""
        ...

    def log_tail(self, job: Job, *, max_bytes: int = 16384, node_rank: int | None = None) -> str:
        """The end of the job's log (``node_rank``: of that node's process or pod, where they differ)."""
        ...
