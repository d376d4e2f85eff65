"""A job spec's errors in words that say how to fix each field: ``SpecError`` (keyed by field name, so forms
and the API show each next to its field), msgspec's decode errors rewritten (``convert``), and the fields'
own bounds checked for a spec built by keywords (``bound_errors``). Standard library and msgspec only.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, TypeVar, get_args, get_origin, get_type_hints

import msgspec
from msgspec import Meta

T = TypeVar("T", bound=msgspec.Struct)


class SpecError(ValueError):
    def __init__(self, errors: dict[str, str]):
        super().__init__("; ".join(f"{k}: {v}" for k, v in errors.items()))
        self.errors = errors


def described(text: str, **bounds: Any) -> Meta:
    """A field's description and bounds, as its ``Annotated`` metadata."""
    return Meta(description=text, **bounds)


_TYPE_WORDS = {
    "int": "must be an integer",
    "float": "must be a number",
    "str": "must be a string",
    "bool": "must be true or false",
    "array": "must be a list",
    "object": "must be an object",
}
_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)


def convert(data: dict[str, Any], cls: type[T], choices: dict[str, tuple[str, ...]]) -> T:
    """``data`` as ``cls``, or a ``SpecError`` whose words say how to fix each field (``choices``: the
    allowed values of the fields with a closed set, by name)."""
    try:
        return msgspec.convert(data, cls)
    except msgspec.ValidationError as e:
        if isinstance(e.__cause__, SpecError):
            raise e.__cause__ from None
        raise SpecError(_decode_error(str(e), choices)) from None


def _decode_error(text: str, choices: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """msgspec's "Expected `int`, got `str` - at `$.kubernetes.gpus_per_node`" as {field: words of the fix}."""
    m = _AT.match(text)
    what, path = (m.group("what"), m.group("path") or "") if m else (text, "")
    key = path.lstrip(".") or "spec"
    top = re.split(r"[.\[]", key)[0]
    if top == "env":
        return {"env": "must be an object of NAME: value strings"}
    if top == "args":
        return {"args": "must be a list of strings"}
    got = re.match(r"Expected `(\w+)(?: \| null)?`(?:, got `\w+`)?$", what)
    if got and key.endswith("[...]"):  # a value of an object (node_selector, ...)
        kind = {"str": "string", "int": "integer", "float": "number"}.get(got.group(1), got.group(1))
        return {key[:-5]: f"must map names to {kind} values"}
    if got:
        return {key: _TYPE_WORDS.get(got.group(1), what)}
    bound = re.match(r"Expected `\w+` (>=|<=|>|<) (\S+)$", what)
    if bound:
        word = {">=": "at least", "<=": "at most", ">": "more than", "<": "less than"}[bound.group(1)]
        return {key: f"must be {word} {bound.group(2)}"}
    enum = re.match(r"Invalid enum value (.*)$", what)
    if enum:
        allowed = choices.get(key.split(".")[-1].split("[")[0], ())
        return {key: f"{enum.group(1)} is not one of {', '.join(allowed)}" if allowed else what}
    return {key: what}


def bound_errors(obj: msgspec.Struct) -> dict[str, str]:
    """The fields' own bounds (their ``Meta``), for a spec built by keywords (decoding checks them too)."""
    errors: dict[str, str] = {}
    for name, meta in metas(type(obj)).items():
        value = getattr(obj, name)
        if type(value) not in (int, float):
            continue
        lo, hi = _lower(meta), _upper(meta)
        if lo is not None and value < lo:
            errors[name] = f"must be at least {lo:g}" if hi is None else f"must be within {lo:g}..{hi:g}"
        elif hi is not None and value > hi:
            errors[name] = f"must be at most {hi:g}" if lo is None else f"must be within {lo:g}..{hi:g}"
    return errors


def _lower(meta: Meta) -> float | None:
    return meta.ge if meta.ge is not None else meta.gt


def _upper(meta: Meta) -> float | None:
    return meta.le if meta.le is not None else meta.lt


_METAS: dict[type, dict[str, Meta]] = {}


def metas(cls: type) -> dict[str, Meta]:
    if cls not in _METAS:
        out = {}
        for name, hint in get_type_hints(cls, include_extras=True).items():
            if get_origin(hint) is Annotated:
                out[name] = next(m for m in get_args(hint)[1:] if isinstance(m, Meta))
        _METAS[cls] = out
    return _METAS[cls]
