"""The ``unbroken`` command run as users run it (the installed console script, in its own process) against a
live test server, with a real API token."""

from __future__ import annotations

import fcntl
import os
import select
import signal
import struct
import subprocess
import sys
import termios
from pathlib import Path

import jsonschema
import pytest

UNBROKEN = Path(sys.executable).with_name("unbroken")
EXAMPLES = Path(__file__).resolve().parents[2] / "trainer" / "examples"


@pytest.fixture()
def cli_env(tmp_path):
    """The environment of a user's shell: no Django settings, a config directory of its own."""
    assert UNBROKEN.exists(), f"{UNBROKEN} is missing: make install (pip install -e ./trainer) puts it there"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "UNBROKEN_"))}
    env["UNBROKEN_CONFIG_DIR"] = str(tmp_path / "config")
    env["COLUMNS"] = "200"
    return env


def make_user(name: str, *, operator: bool):
    from django.contrib.auth.models import Group, User

    from controlplane.jobs.roles import OPERATORS_GROUP

    user = User.objects.create_user(name, password="correct horse battery")
    if operator:
        user.groups.add(Group.objects.get_or_create(name=OPERATORS_GROUP)[0])
    return user


def token_for(user) -> str:
    from controlplane.api.models import ApiToken

    return ApiToken.mint(user=user, name="test")[1]


@pytest.fixture()
def operator_env(cli_env, live_server):
    token = token_for(make_user("op", operator=True))
    return {**cli_env, "UNBROKEN_URL": live_server.url, "UNBROKEN_API_TOKEN": token}


def unbroken(env: dict, *args: str, input: str | None = None, timeout: float = 60,
             cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(UNBROKEN), *args], env=env, input=input, capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def validate(data, schema_name: str) -> None:
    """``data`` is valid against the operator OpenAPI document's ``schema_name`` (its components)."""
    from controlplane.api.openapi import document

    doc = document()
    schema = {"$ref": f"#/components/schemas/{schema_name}", "components": doc["components"]}
    jsonschema.validate(data, schema, cls=jsonschema.Draft202012Validator,
                        format_checker=jsonschema.FormatChecker())


def in_pty(args: list[str], env: dict, cwd) -> tuple[subprocess.Popen, int]:
    """The command under a 160 x 40 pseudo-terminal, as in a user's terminal: (its process, the master fd)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    # Ctrl-C as a terminal's user has it: a runner that started this suite in the background (a
    # non-interactive shell's `&`) left SIGINT ignored, which a child inherits and Python then never turns
    # into KeyboardInterrupt.
    proc = subprocess.Popen([str(UNBROKEN), *args], stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd,
                            start_new_session=True, close_fds=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    os.close(slave)
    return proc, master


def read_pty(master: int, into: bytearray) -> None:
    """Append what the terminal shows now to ``into`` (without waiting)."""
    while select.select([master], [], [], 0)[0]:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the terminal's other end is closed
            return
        if not chunk:
            return
        into += chunk
