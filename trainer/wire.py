"""The wire format between trainer and control plane, and the one shared vocabulary.

Both sides import this module; it depends on the standard library only (no torch, no Django),
so the control plane can import it without pulling in the trainer.

A batch is one JSON object POSTed to ``/api/v1/jobs/<job_id>/ingest`` with
``Authorization: Bearer <job token>``::

    {"v": 1, "sent_at": 1764672000.0, "source": "rank:0",
     "heartbeats": [{"rank": 0, "step": 12, "phase": "train", "at": 1764671999.9,
                     "loss": 6.9, "step_time_s": 0.08, "tokens_per_s": 12000.0,
                     "node": "host-a", "pid": 4242}],
     "events": [{"id": "r0-p4242-17", "kind": "checkpoint", "at": 1764671999.5, "rank": 0,
                 "data": {"step": 10, "mode": "async", "state": "durable", ...}}]}

The response carries the job's pending commands::

    {"accepted": {"heartbeats": 1, "events": 1, "duplicates": 0},
     "commands": [{"id": 7, "kind": "restart", "level": "in_process", "rank": null,
                   "fault": null, "issued_at": 1764671999.0}],
     "server_time": 1764672000.1, "job_status": "running"}

Commands are re-sent until acknowledged (a ``command_ack`` event); the trainer dedupes by id.
Event ids make retries harmless: the control plane stores each (job, id) once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

WIRE_VERSION = 1
MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_HEARTBEATS = 8192
MAX_EVENTS = 2048
MAX_EVENT_ID_LEN = 64
MAX_DATA_KEYS = 64
MAX_STRING_LEN = 4096
# A batch whose sent_at differs from the server clock by more than this is refused (clock skew).
MAX_CLOCK_SKEW_S = 300.0
# Event and heartbeat timestamps may not run ahead of sent_at by more than this.
MAX_FUTURE_S = 5.0


class Phase(StrEnum):
    INIT = "init"
    TRAIN = "train"
    CHECKPOINT_SAVE = "checkpoint_save"
    CHECKPOINT_LOAD = "checkpoint_load"
    EVAL = "eval"  # a slow phase: the checkpoint timeout applies
    DATA = "data"
    RESTARTING = "restarting"
    STOPPED = "stopped"


class FaultClass(StrEnum):
    EXCEPTION = "exception"
    HANG = "hang"
    PROCESS_KILLED = "process_killed"
    NAN_LOSS = "nan_loss"
    HEARTBEAT_LOST = "heartbeat_lost"
    STALLED = "stalled"
    NODE_LOST = "node_lost"
    OOM_KILLED = "oom_killed"
    EVICTED = "evicted"
    UNSCHEDULABLE = "unschedulable"
    IMAGE_PULL = "image_pull"


class DrillFault(StrEnum):
    """Faults the trainer can inject (fault drills)."""

    EXCEPTION = "exception"
    HANG = "hang"  # Python-level hang: the loop spins without progress
    HANG_COLLECTIVE = "hang_collective"  # hang in a C call / collective (GIL released)
    SIGKILL = "sigkill"
    NAN_LOSS = "nan_loss"


class Layer(StrEnum):
    IN_PROCESS = "in_process"
    IN_JOB = "in_job"
    JOB = "job"
    NONE = "none"


class CycleMark(StrEnum):
    """Timestamps of one restart cycle, in order."""

    FAULT = "fault_at"
    DETECTED = "detected_at"
    ABORTED = "aborted_at"
    RESTARTED = "restarted_at"
    CHECKPOINT_LOADED = "checkpoint_loaded_at"
    FIRST_STEP = "first_step_at"


class CheckpointState(StrEnum):
    IN_FLIGHT = "in_flight"
    DURABLE = "durable"
    FAILED = "failed"
    ABANDONED = "abandoned"


class CheckpointMode(StrEnum):
    SYNC = "sync"
    ASYNC = "async"


class CommandKind(StrEnum):
    STOP = "stop"
    RESTART = "restart"
    INJECT_FAULT = "inject_fault"


class EventKind(StrEnum):
    """What an event's ``data`` holds, by kind:

    - ``rank_started``: iteration (in-process), restart_count (in-job), world_size, node, pid
    - ``rank_finished``: step, loss (final)
    - ``fault``: fault (FaultClass), cycle, message, detected_by (a Layer or "trainer"/"launcher")
    - ``cycle``: cycle (key shared by every rank and the launcher), layer, mark (CycleMark),
      step (for restarted/checkpoint_loaded: the step resumed from)
    - ``checkpoint``: step, mode, state, blocking_s, write_s, bytes
    - ``command_ack``: command_id, ok (bool), detail
    - ``launcher``: message (free-form facts only the launcher sees: exit codes, signals)
    - ``integration``: level (0 unmodified script, 1 SDK calls, 2 SDK entrypoint), entrypoint, sdk,
      torch, nvrx (versions) - sent by each rank of a job that runs the user's own code
    """

    RANK_STARTED = "rank_started"
    RANK_FINISHED = "rank_finished"
    FAULT = "fault"
    CYCLE = "cycle"
    CHECKPOINT = "checkpoint"
    COMMAND_ACK = "command_ack"
    LAUNCHER = "launcher"
    INTEGRATION = "integration"


def cycle_key(*, attempt: int = 0, restart_count: int | None = None, iteration: int | None = None) -> str:
    """The key of a restart cycle, identical on every rank, the launcher and the control plane.

    ``attempt`` counts job-level restarts (new processes or pods, started by the control plane),
    ``restart_count`` is ft_launcher's in-job round (TORCHELASTIC_RESTART_COUNT) and ``iteration``
    the in-process Wrapper iteration. A cycle is named by what restarted:
    job-level ``job<A>``; in-job ``a<A>-ij<N>``; in-process ``a<A>-ij<N>-ip<I>``.
    """
    if restart_count is None:
        return f"job{attempt}"
    if iteration is None:
        return f"a{attempt}-ij{restart_count}"
    return f"a{attempt}-ij{restart_count}-ip{iteration}"


class WireError(ValueError):
    """A batch that does not follow this format; ``field`` names the offending path."""

    def __init__(self, message: str, field: str = ""):
        super().__init__(f"{field}: {message}" if field else message)
        self.message = message
        self.field = field


@dataclass(slots=True, frozen=True)
class Heartbeat:
    rank: int
    step: int
    phase: str
    at: float
    loss: float | None = None
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    node: str = ""
    pid: int | None = None


@dataclass(slots=True, frozen=True)
class Event:
    id: str
    kind: str
    at: float
    rank: int | None = None
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class Batch:
    sent_at: float
    heartbeats: list[Heartbeat]
    events: list[Event]
    source: str = ""


_PHASES = frozenset(Phase)
_EVENT_KINDS = frozenset(EventKind)


def _num(v: Any, path: str, *, optional: bool = False) -> float | None:
    if v is None and optional:
        return None
    # bool is an int subclass; a JSON true is not a number.
    if type(v) not in (int, float):
        raise WireError("must be a number", path)
    if not math.isfinite(v):
        if optional:  # NaN/inf loss is a fact worth keeping (a NaN drill); store it as null
            return None
        raise WireError("must be finite", path)
    return float(v)


def _int(v: Any, path: str, *, lo: int = 0) -> int:
    if type(v) is not int:
        raise WireError("must be an integer", path)
    if v < lo:
        raise WireError(f"must be >= {lo}", path)
    return v


def _str(v: Any, path: str, max_len: int = MAX_STRING_LEN) -> str:
    if type(v) is not str:
        raise WireError("must be a string", path)
    if len(v) > max_len:
        raise WireError(f"must be at most {max_len} characters", path)
    return v


def parse_batch(obj: Any, *, now: float, world_size: int | None = None) -> Batch:
    """Validate a decoded JSON batch; raise WireError naming the first bad field.

    Validation is complete before anything is written, so a bad batch is refused whole.
    """
    if type(obj) is not dict:
        raise WireError("the body must be a JSON object")
    v = obj.get("v", WIRE_VERSION)
    if type(v) is not int or v != WIRE_VERSION:
        raise WireError(f"unsupported wire version {v!r}; this server speaks {WIRE_VERSION}", "v")
    sent_at = _num(obj.get("sent_at"), "sent_at")
    assert sent_at is not None
    if abs(sent_at - now) > MAX_CLOCK_SKEW_S:
        raise WireError(
            f"clock skew of {sent_at - now:+.1f} s against the server exceeds {MAX_CLOCK_SKEW_S:.0f} s;"
            " sync the trainer host's clock (NTP)",
            "sent_at",
        )
    latest = sent_at + MAX_FUTURE_S
    hbs_in = obj.get("heartbeats", [])
    evs_in = obj.get("events", [])
    if type(hbs_in) is not list:
        raise WireError("must be a list", "heartbeats")
    if type(evs_in) is not list:
        raise WireError("must be a list", "events")
    if len(hbs_in) > MAX_HEARTBEATS:
        raise WireError(f"at most {MAX_HEARTBEATS} per batch; split the batch", "heartbeats")
    if len(evs_in) > MAX_EVENTS:
        raise WireError(f"at most {MAX_EVENTS} per batch; split the batch", "events")
    hbs = [_heartbeat(h, f"heartbeats[{i}]", latest, world_size) for i, h in enumerate(hbs_in)]
    evs = [_event(e, f"events[{i}]", latest, world_size) for i, e in enumerate(evs_in)]
    source = obj.get("source", "")
    return Batch(sent_at=sent_at, heartbeats=hbs, events=evs, source=_str(source, "source", 128))


def _rank(v: Any, path: str, world_size: int | None) -> int:
    r = _int(v, path)
    if world_size is not None and r >= world_size:
        raise WireError(f"unknown rank {r}: this job has ranks 0..{world_size - 1}", path)
    return r


def _at(v: Any, path: str, latest: float) -> float:
    at = _num(v, path)
    assert at is not None
    if at > latest:
        raise WireError("is later than the batch's sent_at; timestamps must come from the sender's clock", path)
    return at


def _heartbeat(h: Any, path: str, latest: float, world_size: int | None) -> Heartbeat:
    if type(h) is not dict:
        raise WireError("must be an object", path)
    phase = h.get("phase")
    if type(phase) is not str or phase not in _PHASES:
        raise WireError(f"must be one of {sorted(_PHASES)}", f"{path}.phase")
    pid = h.get("pid")
    return Heartbeat(
        rank=_rank(h.get("rank"), f"{path}.rank", world_size),
        step=_int(h.get("step"), f"{path}.step"),
        phase=phase,
        at=_at(h.get("at"), f"{path}.at", latest),
        loss=_num(h.get("loss"), f"{path}.loss", optional=True),
        step_time_s=_num(h.get("step_time_s"), f"{path}.step_time_s", optional=True),
        tokens_per_s=_num(h.get("tokens_per_s"), f"{path}.tokens_per_s", optional=True),
        node=_str(h.get("node", ""), f"{path}.node", 253),
        pid=None if pid is None else _int(pid, f"{path}.pid"),
    )


def _event(e: Any, path: str, latest: float, world_size: int | None) -> Event:
    if type(e) is not dict:
        raise WireError("must be an object", path)
    eid = _str(e.get("id"), f"{path}.id", MAX_EVENT_ID_LEN)
    if not eid:
        raise WireError("must not be empty", f"{path}.id")
    kind = e.get("kind")
    if type(kind) is not str or kind not in _EVENT_KINDS:
        raise WireError(f"must be one of {sorted(_EVENT_KINDS)}", f"{path}.kind")
    rank = e.get("rank")
    data = e.get("data", {})
    if type(data) is not dict:
        raise WireError("must be an object", f"{path}.data")
    if len(data) > MAX_DATA_KEYS:
        raise WireError(f"at most {MAX_DATA_KEYS} keys", f"{path}.data")
    for k, val in data.items():
        if type(val) is str and len(val) > MAX_STRING_LEN:
            raise WireError(f"must be at most {MAX_STRING_LEN} characters", f"{path}.data.{k}")
    return Event(
        id=eid,
        kind=kind,
        at=_at(e.get("at"), f"{path}.at", latest),
        rank=None if rank is None else _rank(rank, f"{path}.rank", world_size),
        data=data,
    )
