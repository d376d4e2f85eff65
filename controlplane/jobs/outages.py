"""The control plane's own outages: recorded as facts, forgiven in deadlines, logged once.

Outage grace (``Outage.GRACE``): time during which the control plane could not receive or evaluate
heartbeats never counts against a rank's deadline. Two beacons tell:

- ``watchdog``: every pass writes its time first (``note_watchdog_pass``); a pass that finds the
  previous one longer than ``watchdog_gap_s()`` ago records a closed ``watchdog`` outage over the gap
  (the broker, beat or worker was down, or the worker was swamped).
- ``ingest``: the web processes tick every ``TICK_S`` (``controlplane.ingest.liveness``); the
  watchdog opens an ``ingest`` outage from the last tick when ticks stop for ``INGEST_STALE_S`` (the
  web is down, stopped, or cannot reach the database) and closes it when they resume. No beacon at
  all (the web does not run this app) means no grace.

The time since the ``ingest`` beacon's last tick is grace too, from the first second on
(``grace_windows``): ticks that stopped are told from slow ones only ``INGEST_STALE_S`` later, when the
outage row opens (back-dated to that tick); otherwise a deadline that fell in those seconds would be
claimed before the outage is on record. So a rank whose deadline (moved by the recorded outages) falls
after the beacon's last tick is not lost until the beacon ticks again: lost-rank detection waits for
ingest to show life after the deadline, at most one tick (``TICK_S``) while ingest is healthy. The
window since the tick merges with the open ``ingest`` outage, which starts at the same tick.

A rank is overdue when ``stale_at + grace_s(windows, last_heartbeat_at, now) < now``: its deadline
moves by the part of every grace window after its last heartbeat (``health.in_grace``, which the
watchdog, with either heartbeat store, and the pages share). Accepted trade-off: a window is
back-dated to the last sign of life, so a rank that died just before an outage is found later by up to
the outage's length.

Dependencies (``redis``, ``database``, ``broker``): ``dependency_failed`` / ``dependency_ok`` keep a
per-process state, so an outage is one warning when this process first sees it and one when it ends,
and one ``Outage`` row (at most one open per component) that ``/metrics`` counts and the dashboard's
banner shows. A row whose process died is closed by the next watchdog pass that shows the dependency
works (the watchdog ran: the broker and the database work; its store call worked: Redis works).
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from controlplane.jobs.models import Beacon, Outage

log = logging.getLogger(__name__)

TICK_S = 1.0
INGEST_STALE_S = 5.0
GRACE_HORIZON = timedelta(days=7)  # older windows cannot overlap a live rank's wait (ingest max age)

Component = Outage.Component


def watchdog_gap_s() -> float:
    """A pause between two watchdog passes longer than this is an outage. Shorter ones are load or the
    broker: with the embedded filesystem transport, passes arrive 2-4 s apart (measured)."""
    return max(5.0, 10 * float(getattr(settings, "WATCHDOG_INTERVAL_S", 0.5)))


def tick(name: str, now: datetime | None = None) -> None:
    """Move a beacon forward to ``now`` (never back)."""
    now = now or timezone.now()
    if not Beacon.objects.filter(name=name, at__lt=now).update(at=now):
        Beacon.objects.get_or_create(name=name, defaults={"at": now})


def open_outage(component: str, started_at: datetime, detail: str = "", *, warn: bool = True) -> bool:
    """Open ``component``'s outage unless one is open; True (and one warning) when this call opened it."""
    try:
        with transaction.atomic():
            Outage.objects.create(component=component, started_at=started_at, detail=detail[:500])
    except IntegrityError:
        return False
    if warn:
        log.warning("control plane: %s unavailable since %s%s", component,
                    started_at.isoformat(timespec="seconds"), f": {detail}" if detail else "")
    return True


def close_outage(component: str, now: datetime) -> bool:
    """Close ``component``'s open outage; True (and one warning) when this call closed it."""
    row = Outage.objects.filter(component=component, ended_at__isnull=True).first()
    if row is None or not Outage.objects.filter(pk=row.pk, ended_at__isnull=True).update(ended_at=now):
        return False
    log.warning("control plane: %s available again after %.1f s", component,
                (now - row.started_at).total_seconds())
    return True


def note_watchdog_pass(now: datetime) -> float:
    """Record this pass; a gap since the previous one longer than ``watchdog_gap_s()`` becomes a closed
    ``watchdog`` outage. Claimed with a conditional UPDATE, so concurrent passes record it once.
    Returns the gap in seconds (0 on the first pass)."""
    prev = Beacon.objects.filter(name=Component.WATCHDOG).values_list("at", flat=True).first()
    if prev is None:
        tick(Component.WATCHDOG, now)
        return 0.0
    if prev >= now or not Beacon.objects.filter(name=Component.WATCHDOG, at=prev).update(at=now):
        return 0.0  # a concurrent pass moved it
    gap = (now - prev).total_seconds()
    if gap > watchdog_gap_s():
        Outage.objects.create(component=Component.WATCHDOG, started_at=prev, ended_at=now,
                              detail=f"the watchdog did not run for {gap:.1f} s")
        log.warning("control plane: the watchdog did not run for %.1f s; that time does not count against "
                    "any rank's heartbeat deadline", gap)
    return gap


def check_ingest(now: datetime) -> None:
    """Open or close the ``ingest`` outage from the web processes' beacon."""
    at = Beacon.objects.filter(name=Component.INGEST).values_list("at", flat=True).first()
    if at is None:
        return
    if (now - at).total_seconds() > INGEST_STALE_S:
        open_outage(Component.INGEST, at, "the web processes stopped ticking (ingest down or stopped)")
    else:
        close_outage(Component.INGEST, now)


def grace_windows(now: datetime) -> list[tuple[float, float]]:
    """Merged (start, end) unix seconds of the grace outages that may overlap a live rank's wait; an
    open one ends at ``now``. The time since the ``ingest`` beacon's last tick is one of them (see the
    module docstring: no ingest outage can have been recorded for it yet)."""
    rows = Outage.objects.filter(component__in=Outage.GRACE).filter(
        Q(ended_at__isnull=True) | Q(ended_at__gte=now - GRACE_HORIZON)).values_list("started_at", "ended_at")
    spans = [(a.timestamp(), (b or now).timestamp()) for a, b in rows]
    last_tick = Beacon.objects.filter(name=Component.INGEST).values_list("at", flat=True).first()
    if last_tick is not None and last_tick < now:
        spans.append((last_tick.timestamp(), now.timestamp()))
    spans.sort()
    merged: list[tuple[float, float]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def grace_s(windows: list[tuple[float, float]], since: float, now: float) -> float:
    """Seconds of ``windows`` inside (``since``, ``now``]: how far a deadline set at ``since`` moves."""
    return sum(max(0.0, min(b, now) - max(a, since)) for a, b in windows)


# --- dependencies: one warning when an outage starts, one when it ends ---------------------------------

_down: dict[str, tuple[float, str]] = {}  # component -> (since, unix seconds; what failed), this process


def dependency_failed(component: str, error: BaseException | str) -> None:
    """``component`` failed in this process: the first failure of an outage warns and opens its row."""
    if component in _down:
        return
    detail = str(error)[:300] or type(error).__name__
    _down[component] = (time.time(), detail)
    log.warning("control plane: %s unavailable (%s); carrying on degraded, recovery is logged once",
                component, detail)
    if component == Component.DATABASE:
        return  # written when it is back
    try:
        open_outage(component, timezone.now(), detail, warn=False)
    except Exception:  # noqa: BLE001 - the database may be away too; the log line is the record then
        pass


def dependency_ok(component: str) -> None:
    """``component`` worked in this process; ends the outage this process saw (cheap when none)."""
    if component not in _down:
        return
    since, detail = _down.pop(component)
    now = timezone.now()
    log.warning("control plane: %s available again after %.1f s", component, time.time() - since)
    try:
        if component == Component.DATABASE:
            Outage.objects.get_or_create(component=component, ended_at=None,
                                         defaults={"started_at": datetime.fromtimestamp(since, tz=now.tzinfo),
                                                   "detail": detail})
        Outage.objects.filter(component=component, ended_at__isnull=True).update(ended_at=now)
    except Exception:  # noqa: BLE001 - the next watchdog pass closes it
        pass


def is_down(component: str) -> bool:
    return component in _down


def close_recovered(now: datetime, *, redis_ok: bool) -> None:
    """A watchdog pass ran (so the broker and the database work): close what its process did not see."""
    for component in (Component.BROKER, Component.DATABASE) + ((Component.REDIS,) if redis_ok else ()):
        if component not in _down:
            close_outage(component, now)


def open_outages(now: datetime) -> list[dict]:
    """What the banner shows: open outages, and a watchdog that has not run for longer than its gap."""
    out = [{"component": c, "since": s, "detail": d} for c, s, d in
           Outage.objects.filter(ended_at__isnull=True).values_list("component", "started_at", "detail")]
    last = Beacon.objects.filter(name=Component.WATCHDOG).values_list("at", flat=True).first()
    if last is not None and (now - last).total_seconds() > watchdog_gap_s():
        out.append({"component": Component.WATCHDOG, "since": last,
                    "detail": "the watchdog is not running: lost ranks are not being detected"})
    return out


def outage_counts() -> dict[str, int]:
    from django.db.models import Count

    return dict(Outage.objects.values_list("component").annotate(n=Count("id")).values_list("component", "n"))


def windows_between(t0: datetime, t1: datetime) -> list[dict]:
    """Grace outages overlapping [t0, t1], for a job's timeline band."""
    return [{"component": c, "start": a, "end": b, "detail": d} for c, a, b, d in
            Outage.objects.filter(component__in=Outage.GRACE, started_at__lte=t1)
            .filter(Q(ended_at__isnull=True) | Q(ended_at__gte=t0))
            .order_by("started_at").values_list("component", "started_at", "ended_at", "detail")]
