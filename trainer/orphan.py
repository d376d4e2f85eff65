"""A rank ends with its launcher: a SIGKILLed ``trainer.launch`` (an OOM kill, ``kill -9``, a lost
container runtime) cannot stop its ranks, and a rank left training would hold the GPUs and keep writing
checkpoints of a job the control plane has moved on from.

``end_with_parent`` watches the parent from a daemon thread and kills this process when the parent
changes (the orphan is re-parented to init or a subreaper). A watch, not ``PR_SET_PDEATHSIG``: the death
signal fires when the *thread* that spawned the child ends, and the standby pool spawns from short-lived
threads. Standard library only (the standby client must start fast).
"""

from __future__ import annotations

import os
import signal
import threading
import time

POLL_S = 0.5
_started: set[int] = set()


def end_with_parent(poll_s: float = POLL_S) -> None:
    """Kill this process (SIGKILL) within ``poll_s`` of its parent's end. Idempotent per process."""
    if os.getpid() in _started:
        return
    _started.add(os.getpid())
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="unbroken-parent-watch", daemon=True).start()
