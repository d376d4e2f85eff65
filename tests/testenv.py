"""Loaded with ``-p tests.testenv`` (see pyproject) before pytest-django imports the settings.

Settings refuse the default secret key with DEBUG off, so tests set their own; test data (run
dirs, the embedded broker) goes under var/test unless UNBROKEN_DATA_DIR says otherwise.
"""

import os

os.environ.setdefault("UNBROKEN_SECRET_KEY", "test-only-secret-key-not-for-production-0123456789")
os.environ.setdefault("UNBROKEN_DATA_DIR", os.path.join(os.path.dirname(os.path.dirname(__file__)), "var", "test"))
# Jobs of the suite run as the test runner (pytest's tmp_path is 0700 root); tests/controlplane/launchers/
# test_job_isolation.py runs one as an unprivileged account.
os.environ.setdefault("UNBROKEN_JOB_USER", "root")
