"""Shared test set-up. The environment defaults live in tests/testenv.py (loaded before Django)."""
