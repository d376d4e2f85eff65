"""Shared test set-up. Settings refuse a default secret key with DEBUG off, so tests set one."""

import os

os.environ.setdefault("UNBROKEN_SECRET_KEY", "test-only-secret-key-not-for-production-0123456789")
os.environ.setdefault("UNBROKEN_DATA_DIR", os.path.join(os.path.dirname(__file__), "..", "var", "test"))
