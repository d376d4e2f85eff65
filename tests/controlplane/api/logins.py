"""The API tests' sign-ins: one password and one Basic header, so the suites that log in by session, by
Basic or by token all make the same users the same way (their fixtures live in this folder's conftest)."""

from __future__ import annotations

import base64

PASSWORD = "correct horse battery"
DOC = "/api/v1/operator/openapi.json"


def basic(username: str, password: str = PASSWORD) -> dict:
    """The ``Authorization: Basic`` header for ``client.get(..., **basic("op"))``."""
    return {"HTTP_AUTHORIZATION": "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()}
