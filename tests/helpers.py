"""Small helpers shared by the end-to-end and browser tests."""

import os
import time

import psutil


def wait_for(predicate, *, timeout_s: float, interval_s: float = 0.25, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def tagged_processes(tag: str) -> list[int]:
    """Processes (other than this one) whose environment carries a local launch's tag."""
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.pid != os.getpid() and p.environ().get("UNBROKEN_LAUNCH_TAG") == tag:
                out.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out
