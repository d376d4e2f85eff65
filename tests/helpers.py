"""Small helpers shared by the end-to-end and browser tests."""

import time


def wait_for(predicate, *, timeout_s: float, interval_s: float = 0.25, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
