"""Loaded with ``-p tests.testenv`` (see pyproject) before pytest-django imports the settings.

Settings refuse the default secret key with DEBUG off, so tests set their own; test data (run
dirs, the embedded broker) goes under var/test unless UNBROKEN_DATA_DIR says otherwise.
"""

import os

os.environ.setdefault("UNBROKEN_SECRET_KEY", "test-only-secret-key-not-for-production-0123456789")
os.environ.setdefault("UNBROKEN_DATA_DIR", os.path.join(os.path.dirname(os.path.dirname(__file__)), "var", "test"))
