"""The web processes' ``ingest`` beacon: a daemon thread ticks it every ``outages.TICK_S``.

When the ticks stop for ``outages.INGEST_STALE_S`` (the web is down or stopped, or cannot reach the
database), the watchdog opens an ``ingest`` outage from the last tick, and that time does not count
against any rank's heartbeat deadline (``controlplane.jobs.outages``). The thread starts with the
first ASGI scope the server sends (uvicorn's lifespan startup), so a web process that takes no
traffic still ticks. Off the request path: a tick is one conditional UPDATE.

The same thread turns this process's load shedding (the ingest fast path answering 429 when its queue
is full, ``ingest.asgi``) into a ``shedding`` outage: opened from the first shed batch, closed at the
last one once none was shed for ``SHED_QUIET_S``. Shed beats arrive later from the trainers' spools,
so that time is outage grace too, and the banner and ``/metrics`` say the control plane sheds load.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)
_started = threading.Event()

SHED_QUIET_S = 2.0
_shed_first: float | None = None  # unix seconds of this process's first shed batch since it last stopped
_shed_last = 0.0
_shed_count = 0
_shed_open = False  # this process opened the ``shedding`` outage


def shed() -> None:
    """A batch was shed (called on the event loop: plain assignments, no I/O)."""
    global _shed_first, _shed_last, _shed_count
    now = time.time()
    if _shed_first is None:
        _shed_first = now
    _shed_last = now
    _shed_count += 1


def _note_shedding(now: float) -> None:
    global _shed_first, _shed_open, _shed_count
    from datetime import UTC, datetime

    from controlplane.jobs import outages

    if _shed_first is None:
        return
    first, last = _shed_first, _shed_last
    if now - last < SHED_QUIET_S:
        if not _shed_open:
            outages.open_outage(outages.Component.SHEDDING, datetime.fromtimestamp(first, tz=UTC),
                                "ingest is over capacity: new batches get 429 and are retried from the trainers' "
                                "spools")
            _shed_open = True
        return
    if _shed_open:
        outages.close_outage(outages.Component.SHEDDING, datetime.fromtimestamp(last, tz=UTC))
        log.warning("ingest: shed %d batches between %s and %s (429, retried by the trainers)", _shed_count,
                    time.strftime("%H:%M:%S", time.gmtime(first)), time.strftime("%H:%M:%S", time.gmtime(last)))
    _shed_open, _shed_first, _shed_count = False, None, 0


def _run() -> None:
    from django.db import connection

    from controlplane.jobs import outages

    while True:
        try:
            outages.tick(outages.Component.INGEST)
            _note_shedding(time.time())
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
