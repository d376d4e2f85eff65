"""Shared test set-up. The environment defaults live in tests/testenv.py (loaded before Django).

End-to-end fixtures: the real control plane (live server, a real Celery worker and beat on an
in-memory broker, in threads of the test process) driving real training processes.
"""

import logging

import pytest
from celery.beat import EmbeddedService
from celery.contrib.testing.worker import start_worker

from controlplane.celery import app as celery_app


def pytest_report_header(config):
    """Which NVRx the trainer runs with in this session (make test runs the nvrx tests with each)."""
    from trainer import nvrx_compat

    return f"nvidia-resiliency-ext: {nvrx_compat.version_str()} (tested: {', '.join(nvrx_compat.SUPPORTED)})"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if exitstatus not in (0, 5):
        from trainer import nvrx_compat

        terminalreporter.write_line(f"(these tests ran with nvidia-resiliency-ext {nvrx_compat.version_str()})")


@pytest.fixture()
def celery_worker_thread():
    """A real Celery worker consuming the default and launch queues in a thread of this process."""
    # The app reads Django settings under the CELERY_ namespace, so override the namespaced keys:
    # an in-memory broker per test, never the shared filesystem queue of earlier runs.
    saved = {k: celery_app.conf.get(k)
             for k in ("CELERY_BROKER_URL", "CELERY_BROKER_TRANSPORT", "CELERY_BROKER_TRANSPORT_OPTIONS")}
    celery_app.conf.CELERY_BROKER_URL = "memory://"
    celery_app.conf.CELERY_BROKER_TRANSPORT = None  # the embedded default names its filesystem transport
    celery_app.conf.CELERY_BROKER_TRANSPORT_OPTIONS = {}
    celery_app.conf.task_always_eager = False
    _drop_connection_pools()  # producers cached by earlier tests would still publish to the old broker
    # Celery's worker set-up sets the root logger's level to its own (ERROR): later tests' log checks
    # (caplog) would see nothing, so the root logger is put back as it was.
    root = logging.getLogger()
    root_level, root_handlers = root.level, list(root.handlers)
    try:
        with start_worker(celery_app, pool="solo", perform_ping_check=False, queues=["default", "launch"],
                          shutdown_timeout=30) as worker:
            yield worker
    finally:
        celery_app.conf.update(saved)
        _drop_connection_pools()
        root.setLevel(root_level)
        root.handlers[:] = root_handlers


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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Before the last test's teardown drops the test database: end the Postgres sessions that
    server threads (the ingest fast path's thread, live servers) keep open for good, so the drop
    does not warn that the database "is being accessed by other users"."""
    if nextitem is None:
        _end_stray_test_db_sessions()
    yield


def _end_stray_test_db_sessions() -> None:
    from django.db import connections

    conn = connections["default"]
    if conn.vendor != "postgresql" or not str(conn.settings_dict.get("NAME", "")).startswith("test_"):
        return
    import psycopg

    mine = conn.connection.info.backend_pid if conn.connection is not None else 0  # the test's own
    try:
        with psycopg.connect(**conn.get_connection_params(), autocommit=True) as own:
            own.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND pid <> pg_backend_pid() AND pid <> %s", [mine])
    except psycopg.Error:
        pass  # nothing to end, or the server is gone: the drop reports what it finds
