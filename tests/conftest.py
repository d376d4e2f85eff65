"""Shared test set-up. The environment defaults live in tests/testenv.py (loaded before Django).

End-to-end fixtures: the real control plane (live server, a real Celery worker and beat on an
in-memory broker, in threads of the test process) driving real training processes.
"""

import pytest
from celery.beat import EmbeddedService
from celery.contrib.testing.worker import start_worker

from controlplane.celery import app as celery_app


@pytest.fixture()
def celery_worker_thread():
    """A real Celery worker consuming the default and launch queues in a thread of this process."""
    # The app reads Django settings under the CELERY_ namespace, so override the namespaced keys:
    # an in-memory broker per test, never the shared filesystem queue of earlier runs.
    saved = {k: celery_app.conf.get(k) for k in ("CELERY_BROKER_URL", "CELERY_BROKER_TRANSPORT_OPTIONS")}
    celery_app.conf.CELERY_BROKER_URL = "memory://"
    celery_app.conf.CELERY_BROKER_TRANSPORT_OPTIONS = {}
    celery_app.conf.task_always_eager = False
    _drop_connection_pools()  # producers cached by earlier tests would still publish to the old broker
    try:
        with start_worker(celery_app, pool="solo", perform_ping_check=False, queues=["default", "launch"],
                          shutdown_timeout=30) as worker:
            yield worker
    finally:
        celery_app.conf.update(saved)
        _drop_connection_pools()


def _drop_connection_pools():
    celery_app._after_fork()  # what Celery does in a forked child: forget pooled connections and producers


@pytest.fixture()
def celery_beat_thread(celery_worker_thread, tmp_path):
    """Real Celery beat (the settings' schedule: watchdog, heartbeat flush, launcher supervision)."""
    beat = EmbeddedService(celery_app, thread=True, schedule_filename=str(tmp_path / "beat-schedule"))
    beat.start()
    yield beat
    beat.stop()


@pytest.fixture()
def e2e_settings(settings, live_server, tmp_path):
    settings.PUBLIC_URL = live_server.url
    settings.DATA_DIR = tmp_path / "data"
    settings.DATA_DIR.mkdir()
    return settings
