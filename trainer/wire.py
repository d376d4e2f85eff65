"""The wire format between trainer and control plane, and the one shared vocabulary.

Both sides import this module; it depends on the standard library only (no torch, no Django),
so the control plane can import it without pulling in the trainer. The shared vocabulary (phases, fault
classes, layers, event kinds: ``trainer.vocabulary``) and the redaction (``trainer.redaction``) are
re-exported here.

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

import json
import math
from dataclasses import MISSING, dataclass, field, fields
from enum import StrEnum
from typing import Any

# The vocabulary and the redaction have modules of their own; both sides import them from here.
from trainer.redaction import MAX_EVIDENCE_CHARS, REDACTED, SECRET_NAME, TOKEN_SHAPES, looks_secret, redact  # noqa: F401
from trainer.vocabulary import (  # noqa: F401
    SLOW_PHASES,
    CheckpointMode,
    CheckpointState,
    CommandKind,
    CycleMark,
    DrillFault,
    EventKind,
    FaultClass,
    Layer,
    Phase,
    RestoredFrom,
    cycle_key,
)

WIRE_VERSION = 1
MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_HEARTBEATS = 8192
MAX_EVENTS = 2048
MAX_EVENT_ID_LEN = 64
MAX_DATA_KEYS = 64
MAX_STRING_LEN = 4096
MAX_NODE_LEN = 253
MAX_SOURCE_LEN = 128
# A batch whose sent_at differs from the server clock by more than this is refused (clock skew).
MAX_CLOCK_SKEW_S = 300.0
# Event and heartbeat timestamps may not run ahead of sent_at by more than this.
MAX_FUTURE_S = 5.0
# ... nor lie further back than this before the server's clock (the control plane's setting
# UNBROKEN_INGEST_MAX_AGE_S; this is its default). Long enough for a reporter to replay its disk spool
# after a week-long outage: a refused batch (422) is dropped by the reporter, so a tight window loses data.
DEFAULT_MAX_AGE_S = 7 * 24 * 3600.0

# Every value that reaches storage is bounded here, once; the ingest fast path
# (controlplane/jobs/ingestion.py) and the OpenAPI schema (controlplane/ingest/openapi.py) use these.
MAX_INT32 = 2**31 - 1  # a Postgres integer column
MAX_INT64 = 2**63 - 1  # a Postgres bigint column
MAX_STEP = MAX_INT32  # steps land in integer columns (Rank.last_step, Job.max_step, Checkpoint.step, ...)
MAX_RANK = MAX_INT32  # and below the job's world size
MAX_PID = MAX_INT32
MAX_BYTES = MAX_INT64
MAX_COMMAND_ID = MAX_INT64
MAX_DURATION_S = 1e7  # step_time_s, blocking_s, write_s, interference_s (~116 days)
MAX_TOKENS_PER_S = 1e15
# An event's ``data``: nesting depth (the top-level object is depth 1) and encoded size.
MAX_DATA_DEPTH = 4
MAX_DATA_BYTES = 16 * 1024


class WireError(ValueError):
    """A batch that does not follow this format; ``field`` names the offending path."""

    def __init__(self, message: str, field: str = ""):
        super().__init__(f"{field}: {message}" if field else message)
        self.message = message
        self.field = field


_NUL = "\x00"
NO_NUL_PATTERN = "^[^\\x00]*$"  # JSON Schema for "no NUL": Postgres text cannot hold one
_NONE_T = type(None)
_NUMBER_T = frozenset({int, float})
_RANK_NOTE = "Must be below the job's world size."


def words(choices) -> str:
    """Allowed values for an error message, as plain strings: ``a, b, c``."""
    return ", ".join(sorted(str(c) for c in choices))


@dataclass(slots=True, frozen=True)
class Window:
    """Where a value may lie that depends on the request: a timestamp from ``earliest`` (server clock
    minus the max age) to ``latest`` (the batch's ``sent_at`` plus MAX_FUTURE_S); a rank below
    ``world_size`` (None: not known here)."""

    earliest: float
    latest: float
    world_size: int | None = None

    def check(self, v: Any, path: str) -> float:
        at = _num(v, path)
        assert at is not None
        if at > self.latest:
            raise WireError(f"is later than the batch's sent_at + {MAX_FUTURE_S:g} s; timestamps must come "
                            "from the sender's clock", path)
        if at < self.earliest:
            raise WireError(f"is older than the server accepts (unix seconds >= {self.earliest:.0f}, "
                            "the server clock minus UNBROKEN_INGEST_MAX_AGE_S); send unix seconds", path)
        return at


_ANY_TIME = Window(earliest=-math.inf, latest=math.inf)


@dataclass(slots=True, frozen=True)
class Rule:
    """What one JSON value of the wire may be: the one definition of each field.

    Everything that reads the wire derives from these: the parser (``check``), the ingest fast path
    (``column_ok``: the same rule over a column of values, at C speed), the OpenAPI schema (``schema``)
    and the words of the docs (``describe``). ``Heartbeat`` and ``Event`` carry one per field
    (``wire_field``); ``EVENT_DATA`` one per checked key of an event's ``data``.

    Types: ``integer``, ``number``, ``string``, ``word`` (one of ``choices``), ``boolean``, ``rank`` (an
    integer below the job's world size), ``time`` (unix seconds inside the request's ``Window``).
    A null is allowed where ``nullable`` (a non-finite number is then stored as null: a NaN loss is a fact
    worth keeping); else it reads "is required".
    """

    type: str
    nullable: bool = False
    lo: float | None = 0
    hi: float | None = None
    max_len: int = MAX_STRING_LEN
    min_len: int = 0
    choices: frozenset[str] | None = None
    description: str = ""

    def check(self, v: Any, path: str, window: Window = _ANY_TIME) -> Any:
        """The value as stored, or WireError naming ``path``."""
        if v is None:
            if self.nullable:
                return None
            raise WireError("is required", path)
        t = self.type
        if t == "integer" or t == "rank":
            n = _int(v, path, lo=-MAX_INT64 - 1 if self.lo is None else int(self.lo),
                     hi=MAX_INT64 if self.hi is None else int(self.hi))
            if t == "rank" and window.world_size is not None and n >= window.world_size:
                raise WireError(f"unknown rank {n}: this job has ranks 0..{window.world_size - 1}", path)
            return n
        if t == "number":
            return _num(v, path, optional=self.nullable, lo=self.lo, hi=self.hi)
        if t == "time":
            return window.check(v, path)
        if t == "word":
            assert self.choices is not None
            return _word(v, path, self.choices)
        if t == "boolean":
            if type(v) is not bool:
                raise WireError("must be true or false", path)
            return v
        s = _str(v, path, self.max_len)
        if len(s) < self.min_len:
            raise WireError("must not be empty", path)
        return s

    def column_ok(self, col: list, window: Window) -> bool:
        """True when ``check`` accepts every value of ``col`` unchanged (False: ask ``check`` which one)."""
        types = frozenset(map(type, col))
        if self.nullable and _NONE_T in types:
            if len(types) == 1:
                return True
            col = [x for x in col if x is not None]
            types = types - {_NONE_T}
        t = self.type
        if t == "integer" or t == "rank":
            hi = MAX_INT64 if self.hi is None else self.hi
            if t == "rank" and window.world_size is not None:
                hi = min(hi, window.world_size - 1)
            return types == {int} and (self.lo is None or min(col) >= self.lo) and max(col) <= hi
        if t == "number" or t == "time":
            # A non-finite value (stored as null, or refused) or an overflowing sum: ``check`` decides.
            if not types <= _NUMBER_T or not math.isfinite(sum(col)):
                return False
            lo, hi = (window.earliest, window.latest) if t == "time" else (self.lo, self.hi)
            return (lo is None or min(col) >= lo) and (hi is None or max(col) <= hi)
        if t == "word":
            return types == {str} and self.choices is not None and self.choices.issuperset(col)
        if t == "string":
            if types != {str}:
                return False
            lengths = list(map(len, col))
            return max(lengths) <= self.max_len and min(lengths) >= self.min_len and _NUL not in "".join(col)
        return types == {bool}

    def schema(self) -> dict[str, Any]:
        """This value in JSON Schema (a ``time``'s bounds depend on the server clock: set when served)."""
        t = self.type
        if t == "word":
            assert self.choices is not None
            s: dict[str, Any] = {"type": "string", "enum": sorted(self.choices)}
        elif t == "string":
            s = {"type": "string", "maxLength": self.max_len, "pattern": NO_NUL_PATTERN}
            if self.min_len:
                s["minLength"] = self.min_len
        elif t in ("integer", "rank", "number"):
            s = {"type": "number" if t == "number" else "integer"}
            if self.lo is not None:
                s["minimum"] = self.lo
            if self.hi is not None:
                s["maximum"] = self.hi
        else:  # time, boolean
            s = {"type": "number" if t == "time" else t}
        if self.nullable:
            s["type"] = [s["type"], "null"]
            if "enum" in s:
                s["enum"] = [*s["enum"], None]
        description = " ".join(x for x in (self.description, _RANK_NOTE if t == "rank" else "") if x)
        if description:
            s["description"] = description
        return s

    def describe(self) -> str:
        """Plain words: ``one of a, b``, ``integer, 0..100``, ``string, at most 64 characters``."""
        if self.choices is not None:
            return "one of " + words(self.choices)
        if self.type == "string":
            return f"string, at most {self.max_len} characters"
        if self.type in ("integer", "rank", "number") and self.hi is not None:
            hi = f"{self.hi:g}" if self.type == "number" else str(int(self.hi))
            return f"{self.type}, {self.lo or 0:g}..{hi}"
        return self.type


def wire_field(rule: Rule, **kw: Any) -> Any:
    """A dataclass field that carries its wire ``Rule``."""
    return field(metadata={"wire": rule}, **kw)


def _choice(e: type[StrEnum], *, nullable: bool = False) -> Rule:
    return Rule("word", nullable=nullable, choices=frozenset(m.value for m in e))


_DURATION = Rule("number", nullable=True, hi=MAX_DURATION_S)


@dataclass(slots=True, frozen=True)
class Heartbeat:
    rank: int = wire_field(Rule("rank", hi=MAX_RANK))
    step: int = wire_field(Rule("integer", hi=MAX_STEP))
    phase: str = wire_field(_choice(Phase))
    at: float = wire_field(Rule("time"))
    loss: float | None = wire_field(Rule("number", nullable=True, lo=None,
                                         description="Non-finite values are stored as null."), default=None)
    step_time_s: float | None = wire_field(_DURATION, default=None)
    tokens_per_s: float | None = wire_field(Rule("number", nullable=True, hi=MAX_TOKENS_PER_S), default=None)
    node: str = wire_field(Rule("string", max_len=MAX_NODE_LEN), default="")
    pid: int | None = wire_field(Rule("integer", nullable=True, hi=MAX_PID), default=None)
    # The rank's own work per step (CPU seconds of its training thread, waits for peers left out), averaged
    # over the job's straggler window: what sets a straggler apart when lock-step collectives give every
    # rank the same ``step_time_s``.
    busy_s: float | None = wire_field(Rule("number", nullable=True, hi=MAX_DURATION_S, description=(
        "The rank's own work per step (CPU seconds, waits for peers left out), averaged over the "
        "straggler window.")), default=None)


@dataclass(slots=True, frozen=True)
class Event:
    id: str = wire_field(Rule("string", max_len=MAX_EVENT_ID_LEN, min_len=1, description=(
        "Unique per job; a repeated id is stored once (retries are harmless).")))
    kind: str = wire_field(_choice(EventKind))
    at: float = wire_field(Rule("time"))
    rank: int | None = wire_field(Rule("rank", nullable=True, hi=MAX_RANK), default=None)
    # Free-form JSON (``_check_json``) whose keys the control plane reads are checked per kind (EVENT_DATA).
    data: dict[str, Any] = field(default_factory=dict)


def rules(cls: type) -> dict[str, Rule]:
    """The wire fields of ``Heartbeat`` or ``Event``, in order, with their rules."""
    return {f.name: f.metadata["wire"] for f in fields(cls) if "wire" in f.metadata}


HEARTBEAT_RULES = rules(Heartbeat)
EVENT_RULES = rules(Event)
HEARTBEAT_DEFAULTS = {f.name: (None if f.default is MISSING else f.default) for f in fields(Heartbeat)}
HEARTBEAT_REQUIRED = tuple(f.name for f in fields(Heartbeat) if f.default is MISSING)


def as_dict(obj: Heartbeat | Event) -> dict[str, Any]:
    """A heartbeat or event as its JSON object (what the reporter sends)."""
    return {f: getattr(obj, f) for f in obj.__slots__}  # type: ignore[union-attr]


@dataclass(slots=True, frozen=True)
class Batch:
    sent_at: float
    heartbeats: list[Heartbeat]
    events: list[Event]
    source: str = ""


def _num(v: Any, path: str, *, optional: bool = False, lo: float | None = None, hi: float | None = None
         ) -> float | None:
    if v is None and optional:
        return None
    # bool is an int subclass; a JSON true is not a number.
    if type(v) not in (int, float):
        raise WireError("must be a number", path)
    if not math.isfinite(v):
        if optional:  # NaN/inf loss is a fact worth keeping (a NaN drill); store it as null
            return None
        raise WireError("must be finite", path)
    if lo is not None and v < lo:
        raise WireError(f"must be >= {lo:g}", path)
    if hi is not None and v > hi:
        raise WireError(f"must be <= {hi:g}", path)
    return float(v)


def _int(v: Any, path: str, *, lo: int = 0, hi: int = MAX_INT64) -> int:
    if type(v) is not int:
        raise WireError("must be an integer", path)
    if v < lo:
        raise WireError(f"must be >= {lo}", path)
    if v > hi:
        raise WireError(f"must be <= {hi}", path)
    return v


def _str(v: Any, path: str, max_len: int = MAX_STRING_LEN) -> str:
    if type(v) is not str:
        raise WireError("must be a string", path)
    if len(v) > max_len:
        raise WireError(f"must be at most {max_len} characters", path)
    if _NUL in v:
        raise WireError("must not contain NUL (\\u0000) characters", path)
    return v


def _word(v: Any, path: str, choices: frozenset) -> str:
    if type(v) is not str or v not in choices:
        raise WireError(f"must be one of {words(choices)}", path)
    return v


def parse_batch(obj: Any, *, now: float, world_size: int | None = None,
                max_age_s: float = DEFAULT_MAX_AGE_S) -> Batch:
    """Validate a decoded JSON batch; raise WireError naming the first bad field.

    Validation is complete (the envelope, every heartbeat and every event's ``data`` for its kind)
    before anything is written, so a bad batch is refused whole.
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
    window = Window(earliest=now - max_age_s, latest=sent_at + MAX_FUTURE_S, world_size=world_size)
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
    hbs = [parse_heartbeat(h, f"heartbeats[{i}]", window) for i, h in enumerate(hbs_in)]
    evs = [_event(e, f"events[{i}]", window) for i, e in enumerate(evs_in)]
    source = obj.get("source", "")
    return Batch(sent_at=sent_at, heartbeats=hbs, events=evs, source=_str(source, "source", MAX_SOURCE_LEN))


def parse_heartbeat(h: Any, path: str, window: Window) -> Heartbeat:
    """One heartbeat object (also used by the control plane on states read back from its store)."""
    if type(h) is not dict:
        raise WireError("must be an object", path)
    get, d = h.get, HEARTBEAT_DEFAULTS
    return Heartbeat(**{name: rule.check(get(name, d[name]), f"{path}.{name}", window)
                        for name, rule in HEARTBEAT_RULES.items()})


def heartbeats_ok(hbs: list[dict], window: Window) -> bool:
    """True when ``parse_heartbeat`` accepts every one of ``hbs`` as it is, with known keys only: the
    same rules, checked column-wise (the ingest hot path: ~5x cheaper than building ``Heartbeat``s). False
    says nothing about which one is wrong: ``parse_heartbeat`` names it."""
    if frozenset(map(type, hbs)) != {dict} or not all(map(_HEARTBEAT_KEYS.issuperset, hbs)):
        return False
    d = HEARTBEAT_DEFAULTS
    return all(rule.column_ok([h.get(name, d[name]) for h in hbs], window)
               for name, rule in HEARTBEAT_RULES.items())


_HEARTBEAT_KEYS = frozenset(HEARTBEAT_RULES)


def _event(e: Any, path: str, window: Window) -> Event:
    if type(e) is not dict:
        raise WireError("must be an object", path)
    values = {name: rule.check(e.get(name), f"{path}.{name}", window) for name, rule in EVENT_RULES.items()}
    data = e.get("data", {})
    if type(data) is not dict:
        raise WireError("must be an object", f"{path}.data")
    if len(data) > MAX_DATA_KEYS:
        raise WireError(f"at most {MAX_DATA_KEYS} keys", f"{path}.data")
    check_event_data(values["kind"], data, path)  # first: the keys the control plane reads have the tighter bounds
    _check_json(data, f"{path}.data", 1)
    size = len(json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass"))
    if size > MAX_DATA_BYTES:
        raise WireError(f"is {size} bytes encoded; at most {MAX_DATA_BYTES}", f"{path}.data")
    return Event(**values, data=data)


def _check_json(v: Any, path: str, depth: int) -> None:
    """Free-form ``data``: storable JSON (no NUL, finite numbers, 64-bit integers), nested at most
    MAX_DATA_DEPTH deep."""
    t = type(v)
    if t is dict or t is list:
        if depth > MAX_DATA_DEPTH:
            raise WireError(f"nests deeper than {MAX_DATA_DEPTH} levels", path)
        if t is dict:
            for k, x in v.items():
                if type(k) is not str or len(k) > MAX_STRING_LEN or _NUL in k:
                    raise WireError(f"has a key that is not a string of at most {MAX_STRING_LEN} characters "
                                    "without NUL (\\u0000)", path)
                _check_json(x, f"{path}.{k}", depth + 1)
        else:
            for i, x in enumerate(v):
                _check_json(x, f"{path}[{i}]", depth + 1)
    elif t is str:
        _str(v, path)
    elif t is int:
        _int(v, path, lo=-MAX_INT64 - 1)
    elif t is float:
        _num(v, path)
    elif v is not None and t is not bool:
        raise WireError("must be JSON (an object, list, string, number, true, false or null)", path)


# --- each event kind's ``data`` -----------------------------------------------------------------------


def _opt(type_: str, **kw: Any) -> Rule:
    return Rule(type_, nullable=True, **kw)


_STEP = _opt("integer", hi=MAX_STEP)
# What the control plane reads from each kind's ``data`` (other keys are stored as they are). A key
# that is not nullable is required.
EVENT_DATA: dict[str, dict[str, Rule]] = {
    EventKind.CYCLE: {"cycle": Rule("string", max_len=64, min_len=1), "mark": _choice(CycleMark),
                      "layer": _choice(Layer, nullable=True), "step": _STEP,
                      "restored_from": _choice(RestoredFrom, nullable=True),
                      "command_id": _opt("integer", hi=MAX_COMMAND_ID)},
    EventKind.FAULT: {"fault": _choice(FaultClass), "cycle": _opt("string", max_len=64),
                      "detected_by": _opt("string", max_len=40), "message": _opt("string"),
                      "node": _opt("string", max_len=MAX_NODE_LEN), "step": _STEP,
                      "rank": _opt("integer", hi=MAX_RANK)},
    EventKind.CHECKPOINT: {"step": Rule("integer", hi=MAX_STEP), "state": _choice(CheckpointState),
                           "mode": _choice(CheckpointMode, nullable=True),
                           "attempt_key": _opt("string", max_len=64), "blocking_s": _DURATION,
                           "write_s": _DURATION, "bytes": _opt("integer", hi=MAX_BYTES),
                           "interference_s": _DURATION},
    EventKind.COMMAND_ACK: {"command_id": Rule("integer", hi=MAX_COMMAND_ID), "ok": Rule("boolean"),
                            "detail": _opt("string")},
}


def check_event_data(kind: str, data: dict, path: str) -> None:
    """Check the keys of ``data`` that the control plane reads for this event kind (``EVENT_DATA``)."""
    for key, rule in EVENT_DATA.get(kind, {}).items():
        rule.check(data.get(key), f"{path}.data.{key}")
