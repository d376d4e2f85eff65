"""What the domain asks of the launcher, without importing it (``controlplane.launchers`` sits above jobs).

A request is a row first, written in the caller's transaction: the job in LAUNCHING, or the restart or
stop ``Command``. Once that transaction commits, ``launcher_requested`` nudges the launcher side, which
connects a receiver in its ``AppConfig.ready`` and enqueues its Celery task. A nudge can be lost (no
broker, a worker that died with the task); the row cannot. The launcher's periodic ``supervise`` pass
carries out every stop whose task never ran (``launchers.services.carry_out_stops``): a stop asked for
here is never lost, even when the broker was down at the time. A lost launch fails visibly after
``launchers.services.LAUNCH_TIMEOUT``; a lost job-level restart stays a pending command on the job page.
"""

from __future__ import annotations

import logging

from django.db import transaction
from django.dispatch import Signal

log = logging.getLogger(__name__)

# Sent after commit with: action ("launch" | "stop" | "restart" | "hold": keep for debugging), job_id,
# command_id (or None), countdown (seconds the launcher waits before acting: the trainer's grace period for a stop).
launcher_requested = Signal()

# A graceful stop: the trainer gets the stop command, saves a final checkpoint and exits; the launcher
# ends whatever is left after this long. Code that never sees the command (Level 0: a script without the
# SDK's calls) gets none: the launcher stops it at once (SIGTERM, SIGKILL after its own grace).
TRAINER_STOP_GRACE_S = 30.0


def request(action: str, *, job_id: int, command_id: int | None = None, countdown: float = 0.0) -> None:
    """Nudge the launcher once the current transaction commits (at once outside a transaction)."""

    def send() -> None:
        receivers = launcher_requested.send_robust(sender=None, action=action, job_id=job_id,
                                                   command_id=command_id, countdown=countdown)
        if not receivers:
            log.error("job %s: no launcher listens for %r requests (is controlplane.launchers installed?)",
                      job_id, action)
        for _receiver, result in receivers:
            if isinstance(result, Exception):
                log.error("job %s: the launcher could not take the %r request now: %s", job_id, action,
                          result, exc_info=result)

    transaction.on_commit(send)
