import logging
import os

from celery import Celery
from celery.signals import after_setup_logger

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("controlplane")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


class PeriodicTaskNoise(logging.Filter):
    """Celery logs every task it receives and finishes at INFO; the beat schedule's tasks run every
    0.5 to 5 s, so at INFO the worker and beat logs would be nothing else. Those lines (received,
    succeeded, "Sending due task") are demoted to DEBUG, and shown only when the log level is DEBUG.
    Their failures and retries keep their level, and other tasks (launch, stop, restart) stay at INFO;
    what a periodic task changes (a rank lost, a job recovered) it logs itself, once."""

    def __init__(self, tasks):
        super().__init__()
        self.tasks = frozenset(tasks)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO:
            return True
        data = getattr(record, "data", None)
        name = data.get("name") if isinstance(data, dict) else None
        beat = record.name == "celery.beat" and isinstance(record.args, tuple) and len(record.args) == 2
        if name is None and beat:
            name = record.args[1]  # "Sending due task %s (%s)": the entry's name, then its task
        if name not in self.tasks:
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger("celery").isEnabledFor(logging.DEBUG)


def periodic_task_names() -> set[str]:
    from django.conf import settings

    return {entry["task"] for entry in settings.CELERY_BEAT_SCHEDULE.values()} | set(QUIET_TASKS)


# Enqueued by ingest after every batch of heartbeats (a flush at most every few seconds): as chatty as
# the beat schedule's tasks.
QUIET_TASKS = ("controlplane.jobs.tasks.flush_heartbeats",)


@after_setup_logger.connect
def quiet_periodic_tasks(**_) -> None:
    """Runs when the worker or beat has set up its logging (settings are loaded by then)."""
    noise = PeriodicTaskNoise(periodic_task_names())
    for name in ("celery.app.trace", "celery.worker.strategy", "celery.beat"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, PeriodicTaskNoise) for f in logger.filters):
            logger.addFilter(noise)

