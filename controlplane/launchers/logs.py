"""The end of a job's log, as the job page and the operator API show it: the text, or why there is none."""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.jobs.models import Job

TAIL_BYTES = 12000


@dataclass(frozen=True, slots=True)
class LogTail:
    text: str | None  # None when there is no log to show
    why: str | None  # why not, when there is none


def log_tail(job: Job, *, max_bytes: int = TAIL_BYTES) -> LogTail:
    if job.backend != "local":
        return LogTail(None, f"log tails are kept for local jobs; see the {job.backend} backend's logs")
    try:
        from controlplane.launchers.backends import get_launcher

        text = get_launcher(job.backend).log_tail(job, max_bytes=max_bytes)
    except Exception as e:  # noqa: BLE001 - the log is optional to its readers: say why, never fail them
        return LogTail(None, f"log not available: {e}")
    if not text:
        return LogTail(None, "no log yet (the job has not started writing one)")
    return LogTail(text, None)
