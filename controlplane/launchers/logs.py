"""The end of a job's log, as the job page, the operator API and a fault's evidence show it: the text,
redacted (``trainer.wire.redact``: a script that prints its environment or its ingest token shows no
secret to a viewer), or why there is none."""

from __future__ import annotations

import re
from dataclasses import dataclass

from controlplane.jobs.models import Fault, Job
from trainer.wire import redact

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
    return LogTail(redact(text), None)


_NODE_RANK = re.compile(r"\bnode rank (\d+)\b")


def fault_log(job: Job, fault: Fault, *, max_bytes: int = 64000) -> LogTail:
    """The log that holds a fault's lines: a local job's log; on Kubernetes, the log of the fault's pod (its
    node rank from the rank, or from a launcher fault's message) while that pod exists."""
    if job.backend != "kubernetes":
        return log_tail(job, max_bytes=max_bytes)
    procs = job.job_spec.procs_per_node
    m = _NODE_RANK.search(fault.message or "")
    node = fault.rank // procs if fault.rank is not None else (int(m.group(1)) if m else None)
    try:
        from controlplane.launchers.backends import get_launcher

        text = get_launcher(job.backend).log_tail(job, max_bytes=max_bytes, node_rank=node)
    except Exception as e:  # noqa: BLE001 - the log is optional to its readers: say why, never fail them
        return LogTail(None, f"the pod's log is not available: {e}")
    if not text:
        which = f"node rank {node}'s pod" if node is not None else "the job's pods"
        return LogTail(None, f"{which} of attempt {job.attempt} has no log (gone with an earlier attempt, or not "
                             "started); Kubernetes keeps a deleted pod's log only in the cluster's log store")
    return LogTail(redact(text), None)
