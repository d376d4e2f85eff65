"""Where the command line finds its server and token: the environment first, then the file that
``unbroken login`` writes."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import click

URL_ENV = "UNBROKEN_URL"
TOKEN_ENV = "UNBROKEN_API_TOKEN"


class NotLoggedIn(click.ClickException):
    exit_code = 3


@dataclass(frozen=True, slots=True)
class Credentials:
    url: str
    token: str


def config_path() -> Path:
    """``~/.config/unbroken/config.json`` on Linux (``UNBROKEN_CONFIG_DIR`` overrides the directory)."""
    base = os.environ.get("UNBROKEN_CONFIG_DIR") or click.get_app_dir("unbroken")
    return Path(base) / "config.json"


def normalise_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise click.BadParameter(f"{url!r}: give the server's address with its scheme, e.g. "
                                 "https://unbroken.example")
    return url


def load() -> Credentials:
    """The credentials to use; raises NotLoggedIn saying how to give them."""
    stored: dict = {}
    path = config_path()
    if path.exists():
        try:
            stored = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise NotLoggedIn(f"cannot read {path}: {e}; run `unbroken login URL` again") from None
    url = os.environ.get(URL_ENV) or stored.get("url")
    token = os.environ.get(TOKEN_ENV) or stored.get("token")
    if not url:
        raise NotLoggedIn(f"no server: run `unbroken login URL`, or set {URL_ENV}")
    if not token:
        raise NotLoggedIn(f"no API token: run `unbroken login {url}`, or set {TOKEN_ENV}")
    return Credentials(url=normalise_url(url), token=token.strip())


def store(creds: Credentials) -> Path:
    """Write the credentials readable by the user alone (0600), replacing the file atomically."""
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        json.dump({"url": creds.url, "token": creds.token}, f)
    os.replace(tmp, path)
    return path
