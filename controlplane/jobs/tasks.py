"""Celery adapters for supervision: thin, periodic, idempotent (beat schedule in settings).

``watchdog`` runs every ``WATCHDOG_INTERVAL_S`` (0.5 s): lost, stalled, restart storms. With the Redis
heartbeat store it also enqueues ``flush_heartbeats`` at most every ``HEARTBEAT_FLUSH_INTERVAL_S``
(so no extra beat entry is needed; a beat entry for it would work as well).
"""

from __future__ import annotations

import logging

from celery import shared_task

from controlplane.jobs import heartbeats, notifications, outages, supervision

log = logging.getLogger(__name__)


@shared_task(ignore_result=True)
def watchdog() -> None:
    supervision.run_watchdog()
    _maybe_schedule_flush()


@shared_task(ignore_result=True)
def flush_heartbeats() -> None:
    heartbeats.get_store().flush()


@shared_task(ignore_result=True)
def send_notifications() -> None:
    notifications.enqueue_missing_failures()
    notifications.send_pending()


def _maybe_schedule_flush() -> None:
    store = heartbeats.get_store()
    if not isinstance(store, heartbeats.RedisHeartbeatStore):
        return
    try:
        due = store.redis.set(store.FLUSH_DUE, "1", nx=True, px=int(heartbeats.flush_interval_s() * 1000))
    except Exception as e:  # noqa: BLE001 - Redis down: ingest falls back to the database meanwhile
        outages.dependency_failed(outages.Component.REDIS, f"cannot schedule the heartbeat flush: {e}")
        return
    outages.dependency_ok(outages.Component.REDIS)
    if due:
        flush_heartbeats.delay()
