"""Free TCP ports on 127.0.0.1. Stdlib only: the control plane imports it too (never torch)."""

from __future__ import annotations

import contextlib
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_block(n: int = 3, tries: int = 100) -> int:
    """A port P with P..P+n-1 all free (a rendezvous port and the stores hosted at +1, +2, ...).

    Raises ``OSError`` when no such block turns up in ``tries`` attempts.
    """
    for _ in range(tries):
        base = free_port()
        if base + n > 65535:
            continue
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base, base + n):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise OSError(f"no {n} consecutive free TCP ports on 127.0.0.1")
