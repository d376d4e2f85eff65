"""The operator API over HTTP, with its failures turned into messages a user can act on."""

from __future__ import annotations

from typing import Any

import click
import httpx2

from trainer.cli.credentials import Credentials

API = "/api/v1"
# Exit codes (docs/reference/cli.md): 1 the job failed or was stopped; 2 bad input (usage, a refused spec);
# 3 credentials missing or refused; 4 the server unreachable or failing.
EXIT_JOB_FAILED, EXIT_INPUT, EXIT_AUTH, EXIT_SERVER = 1, 2, 3, 4


class ApiError(click.ClickException):
    def __init__(self, message: str, *, exit_code: int = EXIT_SERVER, status: int | None = None,
                 body: dict | None = None):
        super().__init__(message)
        self.exit_code = exit_code
        self.status = status
        self.body = body or {}


class Client:
    def __init__(self, creds: Credentials, *, timeout_s: float = 15.0):
        self.base = creds.url
        self._http = httpx2.Client(base_url=creds.url, timeout=timeout_s,
                                   headers={"Authorization": f"Bearer {creds.token}",
                                            "User-Agent": "unbroken-cli"})

    def close(self) -> None:
        self._http.close()

    def page_url(self, job: dict) -> str:
        return self.base + job["links"]["page"]

    def get(self, path: str, **params: Any) -> dict:
        return self._send("GET", path, params={k: v for k, v in params.items() if v is not None})

    def get_file(self, path: str, **params: Any) -> bytes:
        """A read the API answers with a file (not JSON), e.g. the report with ``format=html``."""
        return self._send("GET", path, raw=True, params={k: v for k, v in params.items() if v is not None})

    def post(self, path: str, body: dict) -> dict:
        return self._send("POST", path, json=body)

    def all(self, path: str, key: str, **params: Any) -> list[dict]:
        """Every item of a paged list, following its cursor."""
        out: list[dict] = []
        params.setdefault("limit", 500)
        while True:
            page = self.get(path, **params)
            out += page[key]
            if not page.get("next"):
                return out
            params["after"] = _after(page["next"])

    def _send(self, method: str, path: str, *, raw: bool = False, **kw: Any) -> Any:
        try:
            r = self._http.request(method, API + path, **kw)
        except httpx2.TimeoutException:
            raise ApiError(f"{self.base} did not answer in time: is the server overloaded or down?") from None
        except httpx2.TransportError as e:
            raise ApiError(f"cannot reach {self.base} ({e.__class__.__name__}: {e}): is the server running, "
                           "and is the address right? (unbroken login URL, or UNBROKEN_URL)") from None
        if raw and r.status_code < 400:
            return r.content
        try:
            body = r.json()
        except ValueError:
            body = None
        if r.status_code < 400 and isinstance(body, dict):
            return body
        if not isinstance(body, dict):
            raise ApiError(f"{self.base} answered {r.status_code} without the API's JSON: is {self.base} an "
                           "Unbroken server?", status=r.status_code)
        message = body.get("error") or f"HTTP {r.status_code}"
        if r.status_code == 401:
            raise ApiError(message, exit_code=EXIT_AUTH, status=401, body=body)
        if r.status_code == 403:
            raise ApiError(f"refused: {message} (your token carries your account's role)",
                           exit_code=EXIT_AUTH, status=403, body=body)
        if r.status_code in (400, 404, 409, 413, 422):
            raise ApiError(message, exit_code=EXIT_INPUT, status=r.status_code, body=body)
        raise ApiError(f"the server failed ({r.status_code}): {message}", status=r.status_code, body=body)


def _after(next_link: str) -> int:
    from urllib.parse import parse_qs, urlsplit

    return int(parse_qs(urlsplit(next_link).query)["after"][0])
