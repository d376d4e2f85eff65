"""Library messages that are not true for a job stay out of its log (see trainer/__init__.py)."""

import logging
import subprocess
import sys


def _stderr(code: str) -> str:
    return subprocess.run([sys.executable, "-W", "default", "-c", code], capture_output=True, text=True,
                          timeout=120).stderr


def test_it_silences_pynvmls_deprecation_warning_in_every_job_process():
    assert "pynvml package is deprecated" in _stderr("import pynvml")  # what a job's log began with
    assert "pynvml package is deprecated" not in _stderr("import trainer, pynvml")


def test_it_drops_the_rank_monitors_shutdown_abort_and_keeps_its_other_states():
    import trainer  # noqa: F401  (installs the filter)

    got: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            got.append(record.getMessage())

    logger = logging.getLogger("RankMonServer.Restarter")
    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        logger.debug("[NestedRestarter] name=[InJob] state=handling stage=starting")
        logger.debug("[NestedRestarter] name=[InJob] state=aborted")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert got == ["[NestedRestarter] name=[InJob] state=handling stage=starting"]
