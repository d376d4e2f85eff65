"""The job spec's reference: each field (then ``kubernetes.*``'s and ``drills[].*``'s) with its type,
default, bounds and description, read from the types themselves. The reference page and the operator
OpenAPI read the same facts.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args, get_origin, get_type_hints

import msgspec
from msgspec import Meta

from trainer.jobspec import Drill, JobSpec
from trainer.kubernetes_spec import KubernetesSpec
from trainer.spec_errors import metas
from trainer.wire import DrillFault


class ReferenceRow(msgspec.Struct, frozen=True):
    """One field of the spec as the reference shows it."""

    name: str
    type: str
    default: str
    bounds: str
    description: str


def reference_rows() -> list[ReferenceRow]:
    """The spec's fields (then ``kubernetes.*``'s and ``drills[].*``'s) with type, default, bounds and
    description, from the type itself: the reference page and the operator OpenAPI read the same facts."""
    rows = []
    for prefix, cls in (("", JobSpec), ("kubernetes.", KubernetesSpec), ("drills[].", Drill)):
        hints = get_type_hints(cls, include_extras=True)
        for f in msgspec.structs.fields(cls):
            meta = metas(cls).get(f.name) or Meta()
            rows.append(
                ReferenceRow(
                    name=prefix + f.encode_name,
                    type=_type_words(hints[f.name]),
                    default=_default_words(f),
                    bounds=_bounds_words(meta),
                    description=meta.description or "",
                )
            )
    return rows


def _type_words(hint: Any) -> str:
    if get_origin(hint) is Annotated:
        hint = get_args(hint)[0]
    origin = get_origin(hint)
    if origin is Literal:
        return " | ".join(map(str, get_args(hint)))
    if isinstance(hint, type) and issubclass(hint, DrillFault):
        return " | ".join(f.value for f in hint)
    if origin in (tuple, list):
        return f"list of {_type_words(get_args(hint)[0])}"
    if origin is dict:
        return "object"
    if hint is type(None):
        return "null"
    if origin is not None and type(None) in get_args(hint):
        return " | ".join(_type_words(a) for a in get_args(hint))
    return {int: "integer", float: "number", str: "string", bool: "boolean"}.get(
        hint, getattr(hint, "__name__", str(hint))
    )


def _default_words(f: msgspec.structs.FieldInfo) -> str:
    if f.default is msgspec.NODEFAULT and f.default_factory is msgspec.NODEFAULT:
        return "(required)"
    value = f.default_factory() if f.default is msgspec.NODEFAULT else f.default
    return msgspec.json.encode(value).decode()


def _bounds_words(meta: Meta) -> str:
    parts = []
    for op, v in ((">=", meta.ge), (">", meta.gt), ("<=", meta.le), ("<", meta.lt)):
        if v is not None:
            parts.append(f"{op} {v:g}")
    return ", ".join(parts)
