"""Each rank's own work per step, for the control plane's straggler rule (``controlplane/jobs/health.py``).

In lock-step training every rank's wall step time is the same: the ranks that are not slow wait for the
slow one inside the next collective. What sets a straggler apart is its own work, so each step is also
measured as CPU seconds of the training thread (``time.thread_time``: a wait for a peer blocks and costs
none, and time the OS gave another process is not counted either). Each heartbeat carries the mean over
the job's straggler window (``--straggler-window``), so one slow step (a checkpoint's staging) does not
mark a rank; the control plane compares it with the median of the other ranks'. An attempt's first window
is warm-up (allocator, caches, the restore): the beats carry no ``busy_s`` until the window is full, since
ranks whose beats arrive a moment apart would otherwise be compared on a falling curve at different points
and the one seen later would look slower.

The ``slow_rank`` drill makes a rank a straggler on purpose: from its step on, the rank spends an extra
``fraction`` of its own work per step busy (a CPU spin on the training thread, as a slower processor
would). Accepted trade-off: on GPUs the training thread's CPU time follows kernel launches, not kernel
time; NVRx's CUPTI-based straggler detection is the tool there (see the README).
"""

from __future__ import annotations

import time
from collections import deque


class BusyClock:
    """Per-step CPU time of the calling thread, averaged over a window of wall time. ~1 us a step."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self.slow_fraction = 0.0  # the slow_rank drill's, once fired
        self._mark: float | None = None
        self._spun = 0.0
        self._steps: deque[tuple[float, float]] = deque()  # (wall time, busy seconds) of recent steps
        self._sum = 0.0
        self._since: float | None = None  # the attempt's first step (wall time): warm-up until a window later

    def step(self) -> float | None:
        """Close the step that just ended: the window's mean busy seconds per step (None during the
        attempt's first window). With the slow_rank drill on, spin for its share of the step's own work first."""
        cpu = time.thread_time()
        if self._mark is None:
            self._mark = cpu
            self._since = time.monotonic()
            return None
        busy = cpu - self._mark
        self._mark = cpu
        if self.slow_fraction > 0:
            own = max(0.0, busy - self._spun)  # the drill's own spin of the step before is not work to copy
            until = cpu + own * self.slow_fraction
            while time.thread_time() < until:
                pass
            self._spun = time.thread_time() - cpu  # counted in the next step's busy time, as real work would be
        now = time.monotonic()
        self._steps.append((now, busy))
        self._sum += busy
        while len(self._steps) > 1 and self._steps[0][0] < now - self.window_s:
            self._sum -= self._steps.popleft()[1]
        if self._since is not None and now - self._since < self.window_s:
            return None  # warm-up: the window still holds the attempt's first steps
        return self._sum / len(self._steps)

    def reset(self) -> None:
        """A new attempt: the first step after a restart includes the restore, not a step's work."""
        self._mark = None
        self._spun = 0.0
        self._steps.clear()
        self._sum = 0.0
