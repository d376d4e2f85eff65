"""Celery adapters for supervision: thin, periodic, idempotent. The beat schedule in settings
(``CELERY_BEAT_SCHEDULE``) runs every one of them: ``watchdog`` every ``WATCHDOG_INTERVAL_S`` (lost,
stalled, restart storms), ``flush_heartbeats`` every ``HEARTBEAT_FLUSH_INTERVAL_S`` (the one writer of
``Rank`` rows from the Redis heartbeat store; a no-op with the database store), ``send_notifications``.
"""

from __future__ import annotations

from celery import shared_task

from controlplane.jobs import heartbeats, notifications, supervision


@shared_task(ignore_result=True)
def watchdog() -> None:
    supervision.run_watchdog()


@shared_task(ignore_result=True)
def flush_heartbeats() -> None:
    heartbeats.get_store().flush()


@shared_task(ignore_result=True)
def send_notifications() -> None:
    notifications.enqueue_missing_failures()
    notifications.send_pending()
