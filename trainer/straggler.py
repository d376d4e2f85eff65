"""Each rank's own work per step, for the control plane's straggler rule (``controlplane/jobs/rank_health.py``).

In lock-step training every rank's wall step time is the same: the ranks that are not slow wait for the
slow one inside the next collective. What sets a straggler apart is its own work, so each step is also
measured as CPU seconds of the training thread (its CPU-time clock, read by a sampler thread: a wait
for a peer blocks and costs none, and time the OS gave another process is not counted either). Each
heartbeat carries the mean over the job's straggler window (``--straggler-window``), so one slow step (a
checkpoint's staging) does not mark a rank; the control plane compares it with the median of the other
ranks'. An attempt's first window is warm-up (allocator, caches, the restore): the beats carry no
``busy_s`` until a window has passed, since ranks whose beats arrive a moment apart would otherwise be
compared on a falling curve at different points and the one seen later would look slower.

The ``slow_rank`` drill makes a rank a straggler on purpose: from its step on, the rank spends an extra
``fraction`` of its own work per step busy (a CPU spin on the training thread, as a slower processor
would). Accepted trade-off: on GPUs the training thread's CPU time follows kernel launches, not kernel
time; NVRx's CUPTI-based straggler detection is the tool there (see docs/concepts/stragglers.md).
"""

from __future__ import annotations

import threading
import time
from collections import deque

#: Samples of the training thread's CPU clock per straggler window (at most one every 0.5 s).
SAMPLES_PER_WINDOW = 10


class BusyClock:
    """Per-step CPU time of the training thread, averaged over a window of wall time.

    The loop's ``step()`` only counts the step and returns the newest mean: no system call on the
    step path. Reading a thread's CPU clock is a system call, and on a node whose cores are all busy
    a system call is where the scheduler switches to a waiting process: read on every step it cost
    the step up to 5 ms at p99 here. A sampler thread reads the training thread's clock instead
    (``pthread_getcpuclockid``), ``SAMPLES_PER_WINDOW`` times a window, and the mean is the CPU time
    over the steps counted between the window's first sample and the newest.
    """

    def __init__(self, window_s: float, *, sample_s: float | None = None, thread: bool = True):
        self.window_s = window_s
        self.sample_s = sample_s or min(0.5, window_s / SAMPLES_PER_WINDOW)
        self.slow_fraction = 0.0  # the slow_rank drill's, once fired
        self.busy_s: float | None = None  # the newest window mean (written by the sampler)
        self._thread_wanted = thread
        self._clock: int | None = None  # the training thread's CPU-time clock
        self._steps = 0  # steps closed in this attempt (the loop writes it, the sampler reads it)
        self._epoch = 0  # a new attempt: the sampler starts a new window
        self._seen_epoch = -1
        self._since = 0.0  # the attempt's first sample: warm-up until a window later
        self._samples: deque[tuple[float, float, int]] = deque()  # (wall, cpu, steps), sampler only
        self._spin_mark: float | None = None  # the slow_rank drill's: CPU time at the previous step
        self._spun = 0.0
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    def step(self) -> float | None:
        """Close the step that just ended: the window's mean busy seconds per step (None during the
        attempt's first window). With the slow_rank drill on, spin for its share of the step's own work first."""
        if self._clock is None:
            self._clock = time.pthread_getcpuclockid(threading.get_ident())
            if self._thread_wanted and self._sampler is None:
                self._sampler = threading.Thread(target=self._run, name="unbroken-busy", daemon=True)
                self._sampler.start()
        if self.slow_fraction > 0:
            self._spin()
        self._steps += 1
        return self.busy_s

    def sample(self, now: float | None = None, cpu: float | None = None) -> None:
        """One reading of the training thread's clock (the sampler thread's; tests pass ``now``/``cpu``)."""
        clock = self._clock
        if clock is None:
            return
        epoch, steps = self._epoch, self._steps
        cpu = time.clock_gettime(clock) if cpu is None else cpu
        now = time.monotonic() if now is None else now
        if epoch != self._seen_epoch:  # a new attempt: its first steps are warm-up, not a step's work
            self._seen_epoch, self._since = epoch, now
            self._samples.clear()
        self._samples.append((now, cpu, steps))
        while len(self._samples) > 1 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()
        t0, c0, s0 = self._samples[0]
        if now - self._since < self.window_s or steps <= s0:
            self.busy_s = None  # warm-up, or no step finished in the window (a hang has no beats anyway)
            return
        self.busy_s = (cpu - c0) / (steps - s0)

    def reset(self) -> None:
        """A new attempt (on the loop's thread): the first steps after a restart include the restore."""
        self._epoch += 1
        self._steps = 0
        self.busy_s = None
        self._clock = None  # the attempt may run on another thread
        self._spin_mark, self._spun = None, 0.0

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.sample_s):
            try:
                self.sample()
            except OSError:  # the training thread ended (its clock is gone)
                self._clock = None

    def _spin(self) -> None:
        """The slow_rank drill: spin for ``slow_fraction`` of the step's own CPU time (the drill's own
        spin of the step before is not work to copy), counted in the next step's time as real work is."""
        cpu = time.thread_time()
        if self._spin_mark is not None:
            own = max(0.0, cpu - self._spin_mark - self._spun)
            until = cpu + own * self.slow_fraction
            while time.thread_time() < until:
                pass
        self._spun = time.thread_time() - cpu
        self._spin_mark = cpu
