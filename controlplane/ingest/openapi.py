"""OpenAPI 3.1 description of the ingest API, generated from the wire module's vocabulary and bounds
(``trainer/wire.py``: the one definition; nothing here is retyped).

The time bounds depend on the server clock, which JSON Schema cannot name: the document is served
with ``minimum``/``maximum`` for ``sent_at`` and every ``at`` computed when it is served, as of its
``info.x-server-time``. A schema-driven client that loads it and generates within it agrees with the
server; the rest of the document is built once per process.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from functools import cache

from django.conf import settings

from trainer import wire

MARGIN_S = 60.0


def _data_description() -> str:
    lines = []
    for kind, rules in wire.EVENT_DATA.items():
        parts = [f"`{key}`{'' if rule.nullable else ' (required)'}: {rule.describe()}" for key, rule in rules.items()]
        lines.append(f"- `{kind}`: " + "; ".join(parts))
    return "\n".join(lines)


def _object(cls: type, at: dict, **extra: dict) -> dict:
    """``wire.Heartbeat`` or ``wire.Event`` as a JSON Schema object, from the rules of its fields."""
    props = {}
    for name, rule in wire.rules(cls).items():
        props[name] = {**rule.schema(), **(at if rule.type == "time" else {})}
    required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING]
    return {"type": "object", "required": required, "properties": {**props, **extra}}


def _enum(e) -> list[str]:
    return [m.value for m in e]


def openapi_schema(*, now: float | None = None) -> dict:
    """The document, with its time bounds as of ``now`` (the server clock)."""
    now = time.time() if now is None else now
    doc = copy.deepcopy(_static())
    schemas = doc["components"]["schemas"]
    # Tightened by MARGIN_S, so that the bounds still hold when a client uses them a minute later.
    skew, future, m = wire.MAX_CLOCK_SKEW_S, wire.MAX_FUTURE_S, MARGIN_S
    doc["info"]["x-server-time"] = now
    schemas["Batch"]["properties"]["sent_at"].update(minimum=now - skew + m, maximum=now + skew - m)
    for name in ("Heartbeat", "Event"):
        schemas[name]["properties"]["at"].update(minimum=now - settings.INGEST_MAX_AGE_S + m,
                                                 maximum=now + skew - m + future)
    return doc


@cache
def _static() -> dict:
    at = _time_schema()
    return {
        "openapi": "3.1.0",
        "info": {"title": "Unbroken ingest API", "version": "1",
                 "description": "Machine-facing: trainers and launchers post heartbeats and events, and get "
                                "pending commands back. Wire format: trainer/wire.py."},
        "paths": {
            "/api/v1/jobs/{job_id}/ingest": {"post": _ingest_operation()},
            "/api/v1/openapi.json": {"get": {"operationId": "openapi", "summary": "This document",
                                             "responses": {"200": {"description": "OpenAPI 3.1"}}}},
        },
        "components": {
            "securitySchemes": {"jobToken": {
                "type": "http", "scheme": "bearer",
                "description": "The job's ingest token (shown once at launch)."}},
            "schemas": {"Error": _error_schema(), "Heartbeat": _object(wire.Heartbeat, at),
                        "Event": _event_schema(at), "Batch": _batch_schema(), "Command": _command_schema(),
                        "Accepted": _accepted_schema()},
        },
    }


def _time_schema() -> dict:
    """Every ``at``: its bounds in words (``openapi_schema`` adds them as numbers when it serves)."""
    max_age = settings.INGEST_MAX_AGE_S
    return {"type": "number", "description": (
        f"Unix seconds on the sender's clock. At most {wire.MAX_FUTURE_S:g} s after the batch's sent_at "
        f"(not expressible in JSON Schema: refused with 422), and at most {max_age:.0f} s "
        "(UNBROKEN_INGEST_MAX_AGE_S) before the server clock. minimum/maximum are as of this document's "
        "info.x-server-time, tightened by a minute.")}


def _error_schema() -> dict:
    """Every refusal's body: what is wrong, which field, and on 5xx what of the batch was kept."""
    return {
        "type": "object",
        "required": ["error", "field"],
        "properties": {
            "error": {"type": "string", "description": "What is wrong and how to fix it."},
            "field": {"type": ["string", "null"],
                      "description": "Path of the offending field, e.g. `heartbeats[3].rank`; null when "
                                     "the problem is not one field."},
            "stored": {"type": "object", "required": ["events", "heartbeats"], "additionalProperties": False,
                       "description": "On 5xx: what of this batch the server kept (a retry of the whole "
                                      "batch is safe either way).",
                       "properties": {"events": {"type": "boolean"}, "heartbeats": {"type": "boolean"}}},
        },
        "additionalProperties": False,
    }


def _event_schema(at: dict) -> dict:
    """``wire.Event``, its ``data`` described per event kind (``wire.EVENT_DATA``)."""
    return _object(wire.Event, at, data={
        "type": "object", "maxProperties": wire.MAX_DATA_KEYS,
        "propertyNames": {"type": "string", "maxLength": wire.MAX_STRING_LEN, "pattern": wire.NO_NUL_PATTERN},
        "description": wire.EventKind.__doc__.strip() + "\n\nAny JSON, nested at most "
        f"{wire.MAX_DATA_DEPTH} levels (this object is level 1), at most {wire.MAX_DATA_BYTES} bytes "
        f"encoded, strings of at most {wire.MAX_STRING_LEN} characters without NUL (\\u0000), "
        "integers within 64 bits. Checked per kind (422 naming the key otherwise):\n" + _data_description()})


def _batch_schema() -> dict:
    return {
        "type": "object",
        "required": ["sent_at"],
        "properties": {
            "v": {"type": "integer", "const": wire.WIRE_VERSION},
            "sent_at": {"type": "number", "description": (
                f"Unix seconds; refused (422) when it differs from the server clock by more than "
                f"{wire.MAX_CLOCK_SKEW_S:.0f} s. minimum/maximum are as of this document's "
                "info.x-server-time, tightened by a minute.")},
            "source": wire.Rule("string", max_len=wire.MAX_SOURCE_LEN).schema(),
            "heartbeats": {"type": "array", "maxItems": wire.MAX_HEARTBEATS,
                           "items": {"$ref": "#/components/schemas/Heartbeat"}},
            "events": {"type": "array", "maxItems": wire.MAX_EVENTS,
                       "items": {"$ref": "#/components/schemas/Event"}},
        },
    }


def _command_schema() -> dict:
    """A trainer-bound command as the ingest answer carries it (``Command.to_wire``)."""
    return {
        "type": "object",
        "required": ["id", "kind", "level", "fault", "rank", "issued_at"],
        "properties": {
            "id": {"type": "integer"},
            "kind": {"type": "string", "enum": _enum(wire.CommandKind)},
            "level": {"type": ["string", "null"], "enum": [*_enum(wire.Layer), None]},
            "fault": {"type": ["string", "null"], "enum": [*_enum(wire.DrillFault), None]},
            "rank": {"type": ["integer", "null"], "description": "null: every rank"},
            "issued_at": {"type": "number"},
        },
    }


def _accepted_schema() -> dict:
    return {
        "type": "object",
        "required": ["accepted", "commands", "server_time", "job_status"],
        "properties": {
            "accepted": {"type": "object", "required": ["heartbeats", "events", "duplicates"], "properties": {
                "heartbeats": {"type": "integer"},
                "events": {"type": "integer", "description": "newly stored"},
                "duplicates": {"type": "integer", "description": "events already stored (a retry)"}}},
            "commands": {"type": "array", "items": {"$ref": "#/components/schemas/Command"},
                         "description": "Pending trainer commands, re-sent until acknowledged by a "
                                        "command_ack event; dedupe by id."},
            "server_time": {"type": "number"},
            "job_status": {"type": "string",
                           "description": "The job's status; a finished job gets no commands."},
        },
    }


def _ingest_operation() -> dict:
    """``POST /api/v1/jobs/{job_id}/ingest``: a batch in, pending commands out; every answer it gives."""
    return {
        "operationId": "ingest",
        "summary": "Post a batch of heartbeats and events for one job",
        "description": "Validated whole, then written: events in one transaction, heartbeats after it (a 503 "
                       "says what was kept); a refused batch writes nothing. Idempotent per event id. A "
                       "finished job's batches are still accepted (late facts are kept) but get no commands.",
        "security": [{"jobToken": []}],
        "parameters": [{"name": "job_id", "in": "path", "required": True, "schema": {"type": "integer"}}],
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/Batch"}}}},
        "responses": {
            "200": {"description": "Stored.", "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/Accepted"}}}},
            "400": _error("The body is not JSON."),
            "401": _error("Missing token, a token of another job, or no such job (not distinguished)."),
            "405": _error("Not a POST."),
            "413": _error(f"The body is over {settings.INGEST_MAX_BODY_BYTES} bytes."),
            "422": _error("Valid JSON that breaks the wire format: wrong types, a value out of bounds, an "
                          "unknown rank (>= world size), clock skew, a timestamp outside its window, bad "
                          "event data. `field` names it. Nothing is stored."),
            "500": _error("An unexpected error before anything was stored; retry later."),
            "503": _error("The database or the heartbeat store is unavailable; `stored` says what was kept. "
                          "Retry the whole batch (Retry-After; retries are safe)."),
        },
    }


def _error(description: str) -> dict:
    """An error answer: its description, and the ``Error`` schema as its body."""
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
