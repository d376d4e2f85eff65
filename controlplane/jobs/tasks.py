"""Celery adapters for supervision: thin, periodic, idempotent. The beat schedule in settings
(``CELERY_BEAT_SCHEDULE``) runs every one of them: ``watchdog`` every ``WATCHDOG_INTERVAL_S`` (lost,
stalled, restart storms), ``flush_heartbeats`` every ``HEARTBEAT_FLUSH_INTERVAL_S`` (the one writer of
``Rank`` rows from the Redis heartbeat store; a no-op with the database store), ``send_notifications``.
"""

from __future__ import annotations

from celery import shared_task

from controlplane.jobs import heartbeats, notifications, outages, supervision


@shared_task(ignore_result=True)
def watchdog() -> None:
    supervision.run_watchdog()


@shared_task(ignore_result=True)
def flush_heartbeats() -> None:
    store = heartbeats.get_store()
    if not isinstance(store, heartbeats.RedisHeartbeatStore):
        return
    import redis

    try:
        store.flush()
    except (redis.ConnectionError, redis.TimeoutError) as e:  # one warning per outage, not a traceback per flush
        outages.dependency_failed(outages.Component.REDIS, f"heartbeat flush: {e}; rows wait for Redis")
        return
    outages.dependency_ok(outages.Component.REDIS)


@shared_task(ignore_result=True)
def send_notifications() -> None:
    notifications.enqueue_missing_failures()
    notifications.send_pending()
