import logging
import os

from celery import Celery
from celery.signals import after_task_publish, beat_init, worker_init

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("controlplane")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


class BrokerOutageFilter(logging.Filter):
    """Degraded, not noisy: Celery logs every failed publish (beat: a traceback per due task, 2/s with
    the watchdog) and every reconnect attempt (worker) while the broker is away. Those records become
    one warning when the outage starts and one when it ends (``controlplane.jobs.outages``), and an
    ``Outage`` row that ``/metrics`` counts."""

    def filter(self, record: logging.LogRecord) -> bool:
        from controlplane.jobs import outages

        msg = str(record.msg)
        if msg.startswith(("Message Error", "consumer: Cannot connect", "consumer: Connection to broker lost",
                           "beat: Connection error")):
            err = record.exc_info[1] if record.exc_info else (record.args[1] if isinstance(record.args, tuple)
                                                               and len(record.args) > 1 else msg)
            outages.dependency_failed(outages.Component.BROKER, err)
            return False
        if msg.startswith("Connected to"):
            outages.dependency_ok(outages.Component.BROKER)
        return True


def _quiet(*_, **__) -> None:
    f = BrokerOutageFilter()
    for name in ("celery.beat", "celery.worker.consumer.consumer", "celery.worker.consumer.connection"):
        logging.getLogger(name).addFilter(f)


beat_init.connect(_quiet, weak=False)
worker_init.connect(_quiet, weak=False)


@after_task_publish.connect(weak=False)
def _broker_ok(**_) -> None:
    from controlplane.jobs import outages

    outages.dependency_ok(outages.Component.BROKER)
