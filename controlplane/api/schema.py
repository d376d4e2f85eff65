"""The operator API's types: what its views decode requests into and encode responses from.

Each request body, query string and response is a ``msgspec.Struct``. The views validate with them
(``msgspec.convert``) and serialise with them (``msgspec.json.encode``), and the OpenAPI document
(``controlplane.api.openapi``) is generated from them, so the document cannot drift from the code.
The figures in them come from the functions the job page uses (``Job.goodput``, the model
properties of cycles and faults, ``controlplane.jobs.readouts``); nothing here computes a figure.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from controlplane.jobs.models import CommandStatus, JobStatus, RankHealth
from trainer.wire import CheckpointMode, CheckpointState, CommandKind, DrillFault, FaultClass, Layer, Phase

Time = Annotated[datetime, Meta(extra_json_schema={"format": "date-time"}, description="UTC, RFC 3339")]
Seconds = Annotated[float, Meta(ge=0)]
Share = Annotated[float, Meta(ge=0, le=1)]
NonNegative = Annotated[int, Meta(ge=0)]
Limit = Annotated[int, Meta(ge=1, le=500, description="items per page (1 to 500)")]
After = Annotated[int, Meta(description="the cursor: the `next` link of the previous page carries it")]

JobStatusName = Literal[tuple(s.value for s in JobStatus)]  # type: ignore[valid-type]
CommandStatusName = Literal[tuple(s.value for s in CommandStatus)]  # type: ignore[valid-type]
RankHealthName = Literal[tuple([*(h.value for h in RankHealth), "unknown"])]  # type: ignore[valid-type]


class Error(Struct, omit_defaults=True, kw_only=True):
    """Every error: a sentence saying what is wrong and what to do, and the offending field(s) if any."""

    error: str
    field: str | None = None
    fields: dict[str, str] | None = None
    preflight: list[str] | None = None


# -- requests --------------------------------------------------------------------------------------------


class JobCreate(Struct, forbid_unknown_fields=True, kw_only=True):
    """A job to start. ``spec`` is checked field by field (errors name the fields, 422)."""

    name: Annotated[str, Meta(min_length=1, max_length=100)] = "job"
    spec: dict[str, Any] = {}
    notify_webhook_url: Annotated[str, Meta(max_length=200)] = ""
    notify_email: Annotated[str, Meta(max_length=254)] = ""


class CommandCreate(Struct, forbid_unknown_fields=True, kw_only=True):
    """``stop``; ``restart`` at a ``level`` (optionally one ``rank``); ``inject_fault`` of a drill ``fault``
    into a ``rank``."""

    kind: CommandKind
    level: Layer | None = None
    fault: DrillFault | None = None
    rank: NonNegative | None = None


class Page(Struct, forbid_unknown_fields=True, kw_only=True):
    limit: Limit = 50
    after: After | None = None


class JobsQuery(Page, forbid_unknown_fields=True, kw_only=True):
    status: JobStatusName | None = None


class RanksQuery(Page, forbid_unknown_fields=True, kw_only=True):
    health: RankHealthName | None = None
    node: Annotated[str, Meta(max_length=253, pattern="^[^\\x00]*$")] | None = None


class FaultsQuery(Page, forbid_unknown_fields=True, kw_only=True):
    fault_class: FaultClass | None = None
    layer: Annotated[Layer | None, Meta(description="the layer of the cycle that handled the fault")] = None
    rank: NonNegative | None = None


class CyclesQuery(Page, forbid_unknown_fields=True, kw_only=True):
    layer: Layer | None = None
    open: Annotated[bool | None, Meta(description="true: cycles still recovering; false: finished")] = None


class CheckpointsQuery(Page, forbid_unknown_fields=True, kw_only=True):
    state: CheckpointState | None = None
    mode: CheckpointMode | None = None


class CommandsQuery(Page, forbid_unknown_fields=True, kw_only=True):
    kind: CommandKind | None = None
    status: CommandStatusName | None = None


class SamplesQuery(Page, forbid_unknown_fields=True, kw_only=True):
    rank: NonNegative | None = None


class NoQuery(Struct, forbid_unknown_fields=True):
    pass


# -- responses -------------------------------------------------------------------------------------------


class GoodputParts(Struct, kw_only=True):
    productive: float
    checkpoint_blocking: float
    checkpoint_interference: float
    recovery: float
    lost_work: float
    startup: float
    idle: float


class Goodput(Struct, kw_only=True):
    """Where the wall time went (the job page's goodput). ``shares`` add up to 1, ``seconds`` to
    ``wall_s``; ``goodput`` is the productive share."""

    goodput: Share
    wall_s: Seconds
    shares: GoodputParts
    seconds: GoodputParts


class JobLinks(Struct, kw_only=True):
    self: str
    ranks: str
    faults: str
    cycles: str
    checkpoints: str
    commands: str
    goodput: str
    samples: str
    audit: str
    quarantined: str
    log: str
    page: str


class Job(Struct, kw_only=True):
    id: int
    name: str
    status: JobStatusName
    status_reason: str
    backend: str
    attempt: int
    last_step: Annotated[int, Meta(description=(
        "The job's current step: the highest its ranks reached within 5 s of the newest heartbeat (it "
        "drops with a rollback); once the job is over, the last one reported."))]
    steps: int
    progress_pct: Annotated[int, Meta(ge=0, le=100)]
    created_at: Time
    started_at: Time | None
    first_step_at: Time | None
    finished_at: Time | None
    spec: dict[str, Any]
    links: JobLinks


class Summary(Struct, kw_only=True):
    """Counts over the job's whole history, and its goodput now."""

    goodput: Goodput
    restarts: Annotated[dict[str, int], Meta(description="restart cycles per layer")]
    faults: NonNegative
    checkpoints: Annotated[dict[str, int], Meta(description="saves per state")]
    ranks: Annotated[dict[str, int], Meta(description="ranks per health")]
    commands: Annotated[dict[str, int], Meta(description="commands per status")]
    quarantined: Annotated[NonNegative, Meta(description="ranks with quarantined heartbeat state")]


class Integration(Struct, kw_only=True):
    """For a job running the user's own code: the SDK level its ranks reported and their versions."""

    entrypoint: str
    level: Annotated[int | None, Meta(description="0 unmodified script, 1 SDK calls, 2 SDK entrypoint")]
    versions: dict[str, str]


class RanWith(Struct, kw_only=True):
    """What one attempt ran with, as its launchers reported at start-up."""

    attempt: int | None
    nvrx: Annotated[str, Meta(description="nvidia-resiliency-ext version")]
    torch: str
    python: str


class JobDetail(Job, kw_only=True):
    summary: Summary
    integration: Integration | None
    ran_with: Annotated[list[RanWith], Meta(description="per attempt, newest first")]


class JobList(Struct, kw_only=True):
    jobs: list[Job]
    next: str | None


class Rank(Struct, kw_only=True):
    rank: int
    node: str
    health: RankHealthName
    heartbeat_at: Time | None
    heartbeat_age_s: Seconds | None
    phase: Phase | None
    step: int | None
    loss: float | None
    step_time_s: float | None
    pid: int | None
    busy_s: Annotated[float | None, Meta(description="the rank's own work per step (CPU seconds of its training "
                                                      "thread, waits for peers left out), over the straggler window")]
    slowdown_pct: Annotated[float | None, Meta(description="a straggler's busy_s above the median of the other "
                                                            "ranks', in percent; null when it is not one")]


class RankList(Struct, kw_only=True):
    ranks: list[Rank]
    next: str | None


class FaultEcho(Struct, kw_only=True):
    id: int
    rank: int | None
    fault_class: FaultClass
    why: str


class Fault(Struct, kw_only=True):
    id: int
    at: Annotated[Time, Meta(description="when it happened, as the trainer saw it")]
    detected_at: Time
    fault_class: FaultClass
    rank: int | None
    node: str
    detected_by: str
    message: Annotated[str, Meta(description="the evidence as reported: error text, exit code or signal")]
    traceback: Annotated[str | None, Meta(description="the Python traceback within the message, if any")]
    cycle: Annotated[str | None, Meta(description="the key of the restart cycle that handled it")]
    layer: Layer | None
    escalated_to: Annotated[str | None, Meta(description="that layer gave up; this later cycle recovered")]
    detection_s: Seconds
    recovery_s: Seconds | None
    recovering: bool
    lost_steps: NonNegative | None
    summary: Annotated[str, Meta(description="the fault's one sentence (its page's): who, what, whose "
                                             "failure it echoes, its consequences and repeats")]
    primary: Annotated[int | None, Meta(description="the fault this one is a consequence or a repeat of; "
                                                    "null: this one is a primary fault")]
    link: Annotated[str | None, Meta(description="consequence (an echo of the primary on another rank or "
                                                 "layer) | repeat (the same failure on the next restart) | "
                                                 "null")]
    why: Annotated[str | None, Meta(description="the link in words: 'rank 0: gloo connection reset — a "
                                                "consequence of rank 1's SIGKILL'")]
    count: Annotated[int, Meta(ge=1, description="a primary's occurrences: itself and its repeats")]
    occurrences: Annotated[list[Time], Meta(description="when it happened, each time, oldest first")]
    consequences: Annotated[list[FaultEcho], Meta(description="the faults linked to this one as "
                                                              "consequences")]



class FaultList(Struct, kw_only=True):
    faults: list[Fault]
    next: str | None


class Frame(Struct, kw_only=True):
    file: str
    line: int
    function: str
    code: str


class Evidence(Struct, kw_only=True):
    summary: Annotated[str, Meta(description="one sentence: who, what, where, which layer recovered it how fast, "
                                             "what it cost (the same figures as the fault list)")]
    exception_type: str | None
    exception_message: str | None
    frames: Annotated[list[Frame], Meta(description="the exception's last frames, innermost last")]
    signal: Annotated[str | None, Meta(description="the signal that killed the process, e.g. SIGKILL")]
    exit_code: int | None
    phase: Annotated[str | None, Meta(description="'checkpoint save' when a save was in flight, else 'training'")]
    step: int | None
    log: Annotated[list[str], Meta(description="the rank's and the launcher's log lines around the fault "
                                               "(local jobs; Kubernetes: the rank's pod while it exists), "
                                               "secrets redacted")]
    log_why: str | None
    reason: Annotated[str | None, Meta(description="Kubernetes: the container's termination reason, e.g. "
                                                   "OOMKilled, Error")] = None
    termination_message: Annotated[str | None, Meta(description="Kubernetes: the container's termination "
                                                                "message (capped)")] = None


class FaultDetail(Struct, kw_only=True):
    fault: Fault
    evidence: Evidence


class CycleMarks(Struct, kw_only=True):
    fault_at: Annotated[Time | None, Meta(description="The fault; for an operator's restart, when the "
                                                     "command was issued")]
    delivered_at: Annotated[Time | None, Meta(description="An operator's restart: when the trainer "
                                                         "fetched the command (null otherwise)")]
    detected_at: Time | None
    aborted_at: Time | None
    restarted_at: Time | None
    checkpoint_loaded_at: Time | None
    first_step_at: Time | None


class CycleDurations(Struct, kw_only=True):
    """Seconds between consecutive marks (null where either is missing)."""

    deliver: Annotated[Seconds | None, Meta(description="An operator's restart: issued to fetched by the "
                                                       "trainer (null otherwise)")]
    detect: Seconds | None
    abort: Seconds | None
    restart: Seconds | None
    reload: Seconds | None
    first_step: Seconds | None


class Cycle(Struct, kw_only=True):
    id: int
    key: str
    layer: Layer
    reason: str
    escalated_to: str | None
    superseded: Annotated[bool, Meta(description="a later restart (escalated_to) replaced this attempt: it "
                                                 "is not counted as a restart")]
    marks: CycleMarks
    durations: CycleDurations
    detection_s: Seconds | None
    recovery_s: Seconds | None
    step_at_fault: int | None
    resumed_from_step: int | None
    lost_steps: NonNegative | None


class CycleList(Struct, kw_only=True):
    cycles: list[Cycle]
    next: str | None


class Checkpoint(Struct, kw_only=True):
    id: int
    step: int
    attempt_key: str
    mode: str
    state: CheckpointState
    started_at: Time
    finished_at: Time | None
    blocking_s: float | None
    write_s: float | None
    bytes: int | None
    interference_s: float | None  # async: the extra time of the steps the background save slowed down
    elapsed_s: Seconds | None
    durable_s: Seconds | None
    mb_per_s: float | None


class CheckpointList(Struct, kw_only=True):
    checkpoints: list[Checkpoint]
    next: str | None


class Command(Struct, kw_only=True):
    id: int
    kind: CommandKind
    level: str | None
    fault: str | None
    rank: int | None
    status: CommandStatusName
    detail: str
    issued_by: str | None
    issued_at: Time
    delivered_at: Time | None
    acked_at: Time | None


class CommandList(Struct, kw_only=True):
    commands: list[Command]
    next: str | None


class Sample(Struct, kw_only=True):
    """One heartbeat kept for the loss and throughput history (about one per job every 2 s)."""

    id: int
    at: Time
    rank: int
    step: int
    loss: float | None
    step_time_s: float | None
    tokens_per_s: float | None


class SampleList(Struct, kw_only=True):
    samples: list[Sample]
    next: str | None


class Quarantined(Struct, kw_only=True):
    """Heartbeat state the control plane could not store, per rank (null: the job's progress state)."""

    id: int
    rank: int | None
    reason: str
    payload: str
    at: Annotated[Time, Meta(description="the last time it happened")]
    count: NonNegative


class QuarantinedList(Struct, kw_only=True):
    quarantined: list[Quarantined]
    next: str | None


class Log(Struct, kw_only=True):
    """The end of the job's log (local jobs; about the last 12 KB), or why there is none."""

    text: str | None
    why: str | None


class AuditEntry(Struct, kw_only=True):
    id: int
    at: Time
    actor: str
    action: str
    detail: dict[str, Any]
    remote_addr: str | None


class AuditList(Struct, kw_only=True):
    audit: list[AuditEntry]
    next: str | None


def encode(obj: Struct) -> bytes:
    return msgspec.json.encode(obj)
