"""The web processes' ``ingest`` beacon: a daemon thread ticks it every ``outages.TICK_S``.

When the ticks stop for ``outages.INGEST_STALE_S`` (the web is down or stopped, or cannot reach the
database), the watchdog opens an ``ingest`` outage from the last tick, and that time does not count
against any rank's heartbeat deadline (``controlplane.jobs.outages``). The thread starts with the
first ASGI scope the server sends (uvicorn's lifespan startup), so a web process that takes no
traffic still ticks. Off the request path: a tick is one conditional UPDATE.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)
_started = threading.Event()


def _run() -> None:
    from django.db import connection

    from controlplane.jobs import outages

    while True:
        try:
            outages.tick(outages.Component.INGEST)
            outages.dependency_ok(outages.Component.DATABASE)
        except Exception as e:  # noqa: BLE001 - the database is away: no tick is the signal; reconnect
            outages.dependency_failed(outages.Component.DATABASE, e)
            connection.close()
        time.sleep(outages.TICK_S)


def start() -> None:
    if not _started.is_set():
        _started.set()
        threading.Thread(target=_run, name="ingest-liveness", daemon=True).start()


def with_liveness(app):
    """Wrap an ASGI app so that the process ticks the ``ingest`` beacon while it runs."""

    async def wrapped(scope, receive, send):
        start()
        await app(scope, receive, send)

    return wrapped
