"""What each attempt of a job ran with: the NVRx, torch and Python versions its launchers reported at
start-up (the ``launcher`` event that opens every attempt on every node)."""

from __future__ import annotations

from controlplane.jobs.models import Event, Job
from trainer.wire import EventKind

_KEYS = ("nvrx", "torch", "python")


def runtime_versions(job: Job) -> list[dict]:
    """One entry per attempt and distinct set of versions, newest attempt first: ``{"attempt", "nvrx",
    "torch", "python"}`` (nodes of one attempt normally agree, so they collapse into one entry)."""
    rows = (Event.objects.filter(job=job, kind=EventKind.LAUNCHER, data__has_key="nvrx")
            .order_by("-at").values_list("data", flat=True)[:256])
    seen: set[tuple] = set()
    out = []
    for data in rows:
        entry = {"attempt": data.get("attempt"), **{k: str(data.get(k) or "") for k in _KEYS}}
        key = tuple(entry.values())
        if key not in seen:
            seen.add(key)
            out.append(entry)
    return sorted(out, key=lambda e: -(e["attempt"] if isinstance(e["attempt"], int) else -1))
