"""The core domain: jobs, ranks, events, restart cycles, faults, checkpoints, commands, audit.

Stored columns are facts (times, steps, phases) plus denormalised deadlines (``Rank.stale_at``,
``Rank.stall_at``) that make "is it overdue" one indexed query. Health is computed from facts and
``now`` by methods with no I/O.

One module per idea, every name re-exported here (``from controlplane.jobs.models import Job``):

- ``job``: the job, its statuses and its ingest token;
- ``ranks``: rank rows, training samples, quarantined heartbeat state;
- ``facts``: events as sent, and the restart cycles, faults and checkpoints derived from them;
- ``actions``: commands, the audit trail, the notification outbox;
- ``outages``: the control plane's own outages and beacons.
"""

from controlplane.jobs.models.actions import AuditEntry, Command, CommandStatus, Notification
from controlplane.jobs.models.facts import Checkpoint, Event, Fault, RestartCycle
from controlplane.jobs.models.job import (
    ACTIVE_STATUSES,
    FINAL_STATUSES,
    LAYER_WORDS,
    TOKEN_PREFIX,
    Job,
    JobQuerySet,
    JobStatus,
    hash_token,
)
from controlplane.jobs.models.outages import Beacon, Outage
from controlplane.jobs.models.ranks import (
    QuarantinedHeartbeat,
    Rank,
    RankHealth,
    RankQuerySet,
    TrainingSample,
)

__all__ = ["ACTIVE_STATUSES", "FINAL_STATUSES", "LAYER_WORDS", "TOKEN_PREFIX", "AuditEntry", "Beacon",
           "Checkpoint", "Command", "CommandStatus", "Event", "Fault", "Job", "JobQuerySet", "JobStatus",
           "Notification", "Outage", "QuarantinedHeartbeat", "Rank", "RankHealth", "RankQuerySet",
           "RestartCycle", "TrainingSample", "hash_token"]
