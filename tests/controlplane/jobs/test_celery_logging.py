"""The worker and beat logs: the beat schedule's tasks (every 0.5 to 5 s) log at DEBUG, other tasks at INFO."""

import logging

from controlplane.celery import quiet_periodic_tasks


def _emit(logger_name: str, msg: str, args, level=logging.INFO, data=None) -> list[logging.LogRecord]:
    got: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            got.append(record)

    logger = logging.getLogger(logger_name)
    handler = Keep()
    logger.addHandler(handler)
    old = logging.getLogger("celery").level
    logging.getLogger("celery").setLevel(logging.INFO)
    try:
        logger.log(level, msg, args, extra={"data": data} if data else None)
    finally:
        logger.removeHandler(handler)
        logging.getLogger("celery").setLevel(old)
    return got


def test_it_keeps_periodic_task_chatter_out_of_an_info_log():
    quiet_periodic_tasks()
    watchdog = {"id": "1", "name": "controlplane.jobs.tasks.watchdog", "runtime": 0.01, "return_value": None}
    launch = {"id": "2", "name": "controlplane.launchers.tasks.launch", "runtime": 0.2, "return_value": None}
    assert _emit("celery.app.trace", "Task %(name)s[%(id)s] succeeded", watchdog, data=watchdog) == []
    assert _emit("celery.worker.strategy", "Task %(name)s[%(id)s] received", watchdog, data=watchdog) == []
    assert len(_emit("celery.app.trace", "Task %(name)s[%(id)s] succeeded", launch, data=launch)) == 1
    failed = _emit("celery.app.trace", "Task %(name)s[%(id)s] raised", watchdog, level=logging.ERROR, data=watchdog)
    assert len(failed) == 1  # failures keep their level


def test_it_keeps_beat_quiet_about_sending_periodic_tasks():
    quiet_periodic_tasks()
    logger = logging.getLogger("celery.beat")
    got = []

    class Keep(logging.Handler):
        def emit(self, record):
            got.append(record)

    h = Keep()
    logger.addHandler(h)
    logging.getLogger("celery").setLevel(logging.INFO)
    try:
        logger.info("Scheduler: Sending due task %s (%s)", "watchdog", "controlplane.jobs.tasks.watchdog")
    finally:
        logger.removeHandler(h)
    assert got == []
