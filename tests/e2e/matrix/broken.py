"""A script that cannot start: its import fails on every rank (the same at every level)."""

import not_a_module_of_this_job  # noqa: F401
