"""The job's records: the newest commands, audit entries and the launcher's log tail."""

from __future__ import annotations

from controlplane.dashboard.words import command_summary
from controlplane.jobs.models import AuditEntry, Command, Job
from controlplane.launchers.logs import log_tail


def commands_part(job: Job) -> dict:
    cmds = list(Command.objects.filter(job=job).select_related("issued_by")[:30])
    return {"commands": [{"c": c, "summary": command_summary(c)} for c in cmds]}


def audit_part(job: Job) -> dict:
    return {"entries": list(AuditEntry.objects.filter(job=job)[:30])}


def log_part(job: Job) -> dict:
    tail = log_tail(job)
    if tail.text is None:
        return {"available": False, "why": tail.why}
    return {"available": True, "text": tail.text}
