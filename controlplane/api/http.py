"""What every operator API view does first: authenticate, authorise, parse; and how it answers.

Authentication is a per-user API token (``Authorization: Bearer ubk_...``, ``controlplane.api.models``),
HTTP Basic against the user database (use TLS), or the browser session (then CSRF applies to writes as
for any form). A token carries its user's role. Reading needs any active account; acting needs an operator.
Errors are JSON (``schema.Error``) with the status codes the OpenAPI document declares.
"""

from __future__ import annotations

import base64
import re
from typing import TypeVar
from urllib.parse import urlencode

import msgspec
import orjson
from django.contrib.auth import authenticate
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse

from controlplane.api import schema
from controlplane.api.models import ApiToken
from controlplane.jobs.models import Job
from controlplane.jobs.roles import is_operator

MAX_BODY = 64 * 1024
MAX_DEPTH = 16  # a job spec nests 4 deep (failure_policy[i].match.exit_codes); ingest allows as many
T = TypeVar("T")


class Refused(Exception):
    """Raised by the helpers below with the response to send instead."""

    def __init__(self, status: int, message: str, *, headers: dict | None = None, **extra):
        super().__init__(message)
        self.response = error(status, message, **extra)
        for k, v in (headers or {}).items():
            self.response[k] = v


def respond(obj: msgspec.Struct, status: int = 200) -> HttpResponse:
    return HttpResponse(schema.encode(obj), status=status, content_type="application/json")


def error(status: int, message: str, **extra) -> HttpResponse:
    return respond(schema.Error(error=message, **extra), status)


def _user(request: HttpRequest):
    auth = request.headers.get("Authorization", "")
    if auth.startswith("Bearer "):
        return ApiToken.objects.user_for(auth[7:].strip())
    if auth.startswith("Basic "):
        try:
            username, _, password = base64.b64decode(auth[6:], validate=True).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return None
        return authenticate(request, username=username, password=password)
    if request.user.is_authenticated:
        return request.user
    return None


def authorise(request: HttpRequest, *, act: bool):
    """The requesting user; raises Refused (401 without valid credentials, 403 for a write without the
    CSRF token of a session or from a non-operator: a viewer's API token cannot act either)."""
    scheme = request.headers.get("Authorization", "").partition(" ")[0]
    user = _user(request)
    if user is None and scheme == "Bearer":
        raise Refused(401, "the API token was refused: it is unknown or revoked, or its user is inactive; "
                           "mint a new one on your token page or with manage.py create_api_token",
                      headers={"WWW-Authenticate": 'Bearer realm="unbroken"'})
    if user is None:
        raise Refused(401, "log in: send an API token (Authorization: Bearer) or HTTP Basic credentials "
                           "of an Unbroken account",
                      headers={"WWW-Authenticate": 'Basic realm="unbroken"'})
    if act and scheme not in ("Basic", "Bearer"):
        # Session-authenticated writes need the CSRF token like any form post (a header cannot be forged
        # cross-site, so token and Basic requests need none).
        from django.middleware.csrf import CsrfViewMiddleware

        reason = CsrfViewMiddleware(lambda r: None).process_view(request, None, (), {})
        if reason is not None:
            raise Refused(403, "CSRF check failed: send the csrftoken cookie's value in X-CSRFToken")
    if act and not is_operator(user):
        raise Refused(403, "only operators may start, stop, restart or inject faults")
    return user


def job_or_404(job_id: int) -> Job:
    try:
        return Job.objects.get(pk=job_id)
    except Job.DoesNotExist:
        raise Refused(404, f"no job {job_id}") from None


_AT = re.compile(r" - at `\$\.([A-Za-z_][A-Za-z0-9_]*)")
_UNKNOWN = re.compile(r"unknown field `([^`]*)`")


def _invalid(e: msgspec.ValidationError, what: str) -> Refused:
    text = str(e)
    unknown = _UNKNOWN.search(text)
    if unknown:
        name = unknown.group(1)
        return Refused(422, f"unknown {what}: {name}", field=name, fields={name: f"unknown {what}"})
    at = _AT.search(text)
    return Refused(422, text, field=at.group(1) if at else None)


def query(request: HttpRequest, type_: type[T]) -> T:
    """The query string as ``type_`` (each parameter once); 422 naming the parameter otherwise."""
    params = {}
    for key in request.GET:
        values = request.GET.getlist(key)
        if len(values) != 1:
            raise Refused(422, f"give {key} once", field=key)
        if values[0] != "":
            params[key] = values[0]
    try:
        return msgspec.convert(params, type_, strict=False)
    except msgspec.ValidationError as e:
        raise _invalid(e, "query parameter") from None


def body(request: HttpRequest, type_: type[T]) -> T:
    """The JSON body as ``type_``: 413 when too large (read no further), 400 when not JSON (NaN and
    Infinity are not JSON), nested deeper than MAX_DEPTH or holding NUL, 422 naming the field."""
    try:
        declared = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        raise Refused(400, "Content-Length is not a number") from None
    if declared > MAX_BODY:
        raise Refused(413, f"the body is larger than {MAX_BODY} bytes")
    try:
        raw = request.body
    except RequestDataTooBig:
        raise Refused(413, f"the body is larger than {MAX_BODY} bytes") from None
    if len(raw) > MAX_BODY:
        raise Refused(413, f"the body is larger than {MAX_BODY} bytes")
    try:
        data = orjson.loads(raw or b"{}")
    except orjson.JSONDecodeError as e:
        raise Refused(400, f"malformed JSON (NaN and Infinity are not JSON): {e}") from None
    if not isinstance(data, dict):
        raise Refused(400, "the body must be a JSON object")
    _check_tree(data, "", 1)
    try:
        return msgspec.convert(data, type_)
    except msgspec.ValidationError as e:
        raise _invalid(e, "field") from None


def _check_tree(v, path: str, depth: int) -> None:
    if isinstance(v, dict | list):
        if depth > MAX_DEPTH:
            raise Refused(400, f"depth limit exceeded: the body nests deeper than {MAX_DEPTH} levels",
                          field=path.lstrip(".") or None)
        items = v.items() if isinstance(v, dict) else enumerate(v)
        for k, x in items:
            if isinstance(k, str) and "\x00" in k:
                raise Refused(400, "a key holds NUL (\\u0000)", field=path.lstrip(".") or None)
            _check_tree(x, f"{path}.{k}" if isinstance(k, str) else f"{path}[{k}]", depth + 1)
    elif isinstance(v, str) and "\x00" in v:
        raise Refused(422, "must not hold NUL (\\u0000)", field=path.lstrip(".") or None)


def next_link(request: HttpRequest, q: schema.Page, after: int | None) -> str | None:
    """The link to the page after the one answered (None on the last page); other parameters kept."""
    if after is None:
        return None
    params = {k: v for k, v in request.GET.items() if k not in ("after", "limit") and v != ""}
    params.update(limit=q.limit, after=after)
    return f"{request.path}?{urlencode(params)}"


def keyset(qs, q: schema.Page, *, key: str = "id", descending: bool = False) -> tuple[list, int | None]:
    """One page of ``qs`` in ``key`` order after the cursor ``q.after``; returns (rows, the next cursor)."""
    if q.after is not None:
        qs = qs.filter(**{f"{key}__{'lt' if descending else 'gt'}": q.after})
    rows = list(qs.order_by(f"-{key}" if descending else key)[: q.limit + 1])
    if len(rows) <= q.limit:
        return rows, None
    rows = rows[: q.limit]
    return rows, getattr(rows[-1], key)
