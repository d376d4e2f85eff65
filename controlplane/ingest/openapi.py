"""OpenAPI 3.1 description of the ingest API, built from the wire module's vocabulary and limits."""

from __future__ import annotations

from functools import cache

from django.conf import settings

from trainer import wire


def _enum(e) -> list[str]:
    return [m.value for m in e]


def _num(nullable: bool = False) -> dict:
    return {"type": ["number", "null"]} if nullable else {"type": "number"}


@cache
def openapi_schema() -> dict:
    error = {
        "type": "object",
        "required": ["error", "field"],
        "properties": {
            "error": {"type": "string", "description": "What is wrong and how to fix it."},
            "field": {"type": ["string", "null"],
                      "description": "Path of the offending field, e.g. `heartbeats[3].rank`; null when "
                                     "the problem is not one field."},
        },
        "additionalProperties": False,
    }
    heartbeat = {
        "type": "object",
        "required": ["rank", "step", "phase", "at"],
        "properties": {
            "rank": {"type": "integer", "minimum": 0, "description": "Must be below the job's world size."},
            "step": {"type": "integer", "minimum": 0},
            "phase": {"type": "string", "enum": _enum(wire.Phase)},
            "at": {"type": "number", "description": "Unix seconds on the sender's clock; at most "
                                                    f"{wire.MAX_FUTURE_S:.0f} s after sent_at."},
            "loss": {**_num(True), "description": "Non-finite values are stored as null."},
            "step_time_s": _num(True),
            "tokens_per_s": _num(True),
            "node": {"type": "string", "maxLength": 253},
            "pid": {"type": ["integer", "null"], "minimum": 0},
        },
    }
    event = {
        "type": "object",
        "required": ["id", "kind", "at"],
        "properties": {
            "id": {"type": "string", "minLength": 1, "maxLength": wire.MAX_EVENT_ID_LEN,
                   "description": "Unique per job; a repeated id is stored once (retries are harmless)."},
            "kind": {"type": "string", "enum": _enum(wire.EventKind)},
            "at": {"type": "number"},
            "rank": {"type": ["integer", "null"], "minimum": 0},
            "data": {"type": "object", "maxProperties": wire.MAX_DATA_KEYS,
                     "description": wire.EventKind.__doc__.strip() + "\n\nChecked per kind: cycle (cycle, mark "
                     f"in {_enum(wire.CycleMark)}, layer, step), fault (fault in {_enum(wire.FaultClass)}), "
                     f"checkpoint (step, state in {_enum(wire.CheckpointState)}, mode), command_ack "
                     "(command_id, ok)."},
        },
    }
    batch = {
        "type": "object",
        "required": ["sent_at"],
        "properties": {
            "v": {"type": "integer", "const": wire.WIRE_VERSION},
            "sent_at": {"type": "number", "description": "Unix seconds; refused (422) when it differs from the "
                                                         f"server clock by more than {wire.MAX_CLOCK_SKEW_S:.0f} s."},
            "source": {"type": "string", "maxLength": 128},
            "heartbeats": {"type": "array", "maxItems": wire.MAX_HEARTBEATS, "items": {"$ref": "#/components/schemas/Heartbeat"}},
            "events": {"type": "array", "maxItems": wire.MAX_EVENTS, "items": {"$ref": "#/components/schemas/Event"}},
        },
    }
    command = {
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
    accepted = {
        "type": "object",
        "required": ["accepted", "commands", "server_time", "job_status"],
        "properties": {
            "accepted": {"type": "object", "required": ["heartbeats", "events", "duplicates"], "properties": {
                "heartbeats": {"type": "integer"}, "events": {"type": "integer", "description": "newly stored"},
                "duplicates": {"type": "integer", "description": "events already stored (a retry)"}}},
            "commands": {"type": "array", "items": {"$ref": "#/components/schemas/Command"},
                         "description": "Pending trainer commands, re-sent until acknowledged by a command_ack "
                                        "event; dedupe by id."},
            "server_time": {"type": "number"},
            "job_status": {"type": "string", "description": "The job's status; a finished job gets no commands."},
        },
    }

    def err(description: str) -> dict:
        return {"description": description,
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}

    return {
        "openapi": "3.1.0",
        "info": {"title": "Unbroken ingest API", "version": "1",
                 "description": "Machine-facing: trainers and launchers post heartbeats and events, and get "
                                "pending commands back. Wire format: trainer/wire.py."},
        "paths": {
            "/api/v1/jobs/{job_id}/ingest": {
                "post": {
                    "operationId": "ingest",
                    "summary": "Post a batch of heartbeats and events for one job",
                    "description": "Validated whole, then written in one transaction: a refused batch writes "
                                   "nothing. Idempotent per event id. A finished job's batches are still "
                                   "accepted (late facts are kept) but get no commands.",
                    "security": [{"jobToken": []}],
                    "parameters": [{"name": "job_id", "in": "path", "required": True,
                                    "schema": {"type": "integer"}}],
                    "requestBody": {"required": True, "content": {"application/json": {
                        "schema": {"$ref": "#/components/schemas/Batch"}}}},
                    "responses": {
                        "200": {"description": "Stored.", "content": {"application/json": {
                            "schema": {"$ref": "#/components/schemas/Accepted"}}}},
                        "400": err("The body is not JSON."),
                        "401": err("Missing token, a token of another job, or no such job (not distinguished)."),
                        "405": err("Not a POST."),
                        "413": err(f"The body is over {settings.INGEST_MAX_BODY_BYTES} bytes."),
                        "422": err("Valid JSON that breaks the wire format: wrong types, an unknown rank "
                                   "(>= world size), clock skew, bad event data. `field` names it."),
                        "503": err("The database is unavailable; retry (Retry-After)."),
                    },
                }
            },
            "/api/v1/openapi.json": {"get": {"operationId": "openapi", "summary": "This document",
                                             "responses": {"200": {"description": "OpenAPI 3.1"}}}},
        },
        "components": {
            "securitySchemes": {"jobToken": {"type": "http", "scheme": "bearer",
                                             "description": "The job's ingest token (shown once at launch)."}},
            "schemas": {"Error": error, "Heartbeat": heartbeat, "Event": event, "Batch": batch,
                        "Command": command, "Accepted": accepted},
        },
    }
