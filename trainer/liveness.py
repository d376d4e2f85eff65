"""How a rank tells the restart layers its loop is alive, without a send on the loop's step.

- ``Pacer``: the one thread that sends a progress signal every period when the loop progressed since the
  last one (the loop only counts). ft_launcher's heartbeats (``FtHeartbeats``) and NVRx's in-process
  progress pings (``ProgressMark``'s fallback) are each one ``Pacer`` armed with their send.
- ``ProgressMark``: the in-process layer's progress, written into NVRx's own watchdog timestamp.
- ``NoRestart`` and ``NullFt``: what stands in when in-process restart or ft_launcher is off.

NB: no ``from __future__ import annotations``, as in ``trainer.resilience``.
"""

import contextlib
import faulthandler
import threading
import time
from typing import Any, Callable, Optional


class NoRestart:
    """The restart scope when in-process restart is off: iteration 0, no watchdog, no atomic lock."""

    iteration = 0

    def ping(self) -> None:
        pass

    def atomic(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class Pacer:
    """A thread that sends a progress signal every ``period_s`` when the loop made progress since the
    last one: the loop only counts (``tick``: O(1), no system call, no IPC on the step). A hung loop
    counts nothing, so the signals stop as they would if the loop sent them itself (detected at most
    ``period_s`` later).

    The signal is the ``send`` it is armed with; disarmed (between attempts, or stopped), nothing is sent,
    and arming again counts from the progress already made. ``keep_alive`` sends whether or not the loop
    progresses, up to a time (a slow phase with no steps). ``_lock`` serialises a send with an arm or a
    disarm, so what the send uses can be swapped (a new scope, a reconnected client) after a disarm.
    ``after_send`` runs after each send, outside the lock."""

    def __init__(self, period_s: float, *, thread_name: str = "unbroken-pacer",
                 after_send: Optional[Callable[[], None]] = None):
        self.period_s = period_s
        self.progress = 0
        self._sent = 0
        self._send: Optional[Callable[[], None]] = None
        self._after_send = after_send
        self._alive_until = 0.0
        self._thread_name = thread_name
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def tick(self) -> None:
        self.progress += 1

    def arm(self, send: Callable[[], None]) -> None:
        """Send with ``send`` from now on; after ``stop`` (an in-process restart's finalize stops the
        ft_launcher heartbeats, the next attempt arms them again) a new thread does."""
        with self._lock:
            self._send, self._sent = send, self.progress
            if self._thread is None or self._stop.is_set():
                self._stop = threading.Event()  # the stopped thread keeps its own (set) event and ends
                self._thread = threading.Thread(target=self._run, args=(self._stop,), name=self._thread_name,
                                                daemon=True)
                self._thread.start()

    def disarm(self) -> None:
        with self._lock:
            self._send = None

    def keep_alive(self, until: float) -> None:
        """Keep sending until ``until`` (monotonic seconds) whether or not the loop progresses."""
        self._alive_until = until

    def stop(self) -> None:
        """The thread ends at its next wake (``arm`` starts another)."""
        with self._lock:
            self._send = None
            self._stop.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def _run(self, stop: threading.Event) -> None:
        while not stop.wait(self.period_s):
            with self._lock:
                progress = self.progress
                due = progress != self._sent or time.monotonic() < self._alive_until
                if self._send is None or not due:
                    continue
                self._sent = progress
                with contextlib.suppress(Exception):
                    self._send()
            if self._after_send is not None:
                self._after_send()


# -- in-job: ft_launcher rank monitor client -----------------------------------------------------------


class NullFt:
    def start(self) -> None:
        pass

    def heartbeat(self) -> None:
        pass

    def stop(self) -> None:
        pass


class FtClient:
    """Liveness for ft_launcher: heartbeats to this rank's monitor."""

    def __init__(self) -> None:
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

        self._client = RankMonitorClient()

    def start(self) -> None:
        # Reconnect on every in-process iteration: the rank may have been reassigned.
        self.stop()
        self._client.init_workload_monitoring()

    def heartbeat(self) -> None:
        self._client.send_heartbeat()

    def stop(self) -> None:
        if self._client.is_initialized:
            with contextlib.suppress(Exception):
                self._client.shutdown_workload_monitoring()


class FtHeartbeats:
    """ft_launcher heartbeats for the SDK: ``heartbeat`` counts progress, a ``Pacer`` sends them, also
    while ``keep_alive`` holds the rank alive through a slow phase without progress.

    ``stack_file``: a hang that only ft_launcher catches has no in-process layer to take the hung rank's
    stack, and ft_launcher kills it with SIGKILL. So each heartbeat sent re-arms ``faulthandler``'s
    watchdog (``dump_traceback_later``, C-level: it writes every thread's stack even while the main thread
    is stuck in a C call holding the GIL) to write the stacks to that file ``dump_after_s`` after the last
    heartbeat, before ft_launcher's timeout ends the rank; the launcher's hooks attach it to the fault."""

    def __init__(self, client: FtClient, period_s: float = 1.0, *, stack_file: Any = None,
                 dump_after_s: float = 0.0):
        self._client = client
        self._stack_file, self._dump_after_s = stack_file, dump_after_s
        self._armed_at = float("-inf")
        self.pacer = Pacer(period_s, thread_name="unbroken-ft", after_send=self._rearm_stack_dump)

    def start(self) -> None:
        self.pacer.disarm()  # no heartbeat while the client reconnects
        self._client.start()
        self.pacer.arm(self._client.heartbeat)

    def heartbeat(self) -> None:
        self.pacer.tick()

    def keep_alive(self, until: float) -> None:
        self.pacer.keep_alive(until)

    def stop(self) -> None:
        self.pacer.stop()
        if self._stack_file is not None:
            faulthandler.cancel_dump_traceback_later()
        self._client.stop()

    def _rearm_stack_dump(self) -> None:
        # Re-armed at most every eighth of its delay (each arming joins faulthandler's watchdog thread and
        # starts a new one): the stacks are written between 7/8 of the delay and the delay after the last
        # heartbeat, still before ft_launcher's timeout.
        now = time.monotonic()
        due = now - self._armed_at >= self._dump_after_s / 8
        if self._stack_file is not None and not self.pacer.stopped and due:
            self._armed_at = now
            self._stack_file.seek(0)
            self._stack_file.truncate()  # the file holds the latest hang's stacks only
            faulthandler.dump_traceback_later(self._dump_after_s, file=self._stack_file)


# -- in-process: the progress NVRx's watchdog sends ------------------------------------------------------


class ProgressMark:
    """The loop's progress for the in-process layer, with no send of ours: each ``tick`` (once a step, on
    the loop) writes the time of that progress into the armed scope's progress-watchdog timestamp
    (``CallWrapper.progress_watchdog.timestamp.manual``, what ``CallWrapper.ping`` sets), which NVRx's
    own watchdog thread already sends to the monitor process every ``progress_watchdog_interval``.
    ``ping`` sends at once instead (a put on a multiprocessing queue, a wake of its feeder thread, the
    monitor process's read): from a thread of ours every 0.2 s that was ~10 wakes a second per rank,
    each taking the interpreter lock from the loop, for a timestamp the watchdog delivers anyway. The
    monitor now sees when the loop last progressed, not when a later ping went out, so a hang is
    detected ``soft_timeout`` after the last step (was up to one ping period later).

    ``tick`` is an attribute write and a monotonic clock read (vDSO: no system call). Between attempts
    nothing is armed (the Wrapper resets the watchdog's timestamp for the next one). A scope with no
    progress watchdog (an NVRx that moved it) gets pings (``CallWrapper.ping``) from a ``Pacer`` instead,
    armed with that attempt's scope only: no ping can land in a restart. Off the loop: ``ping`` is a put
    on a multiprocessing queue to the monitor process (a lock, a wake-up of the queue's feeder thread);
    on the loop it cost the step up to a few ms at p99 on a node whose cores are all busy. In-process
    restart off (``NoRestart``): nothing."""

    def __init__(self, fallback_period_s: float = 0.2):
        self._watchdog: Any = None
        self._fallback_period_s = fallback_period_s
        self._fallback: Optional[Pacer] = None

    def arm(self, scope: Any) -> None:
        self.disarm()
        watchdog = getattr(scope, "progress_watchdog", None)
        if watchdog is not None and hasattr(watchdog, "timestamp"):
            self._watchdog = watchdog
        elif not isinstance(scope, NoRestart):
            if self._fallback is None:
                self._fallback = Pacer(self._fallback_period_s, thread_name="unbroken-ping")
            self._fallback.arm(scope.ping)

    def tick(self) -> None:
        watchdog = self._watchdog
        if watchdog is not None:
            watchdog.timestamp.manual = time.monotonic()
        elif self._fallback is not None:
            self._fallback.tick()

    def disarm(self) -> None:
        self._watchdog = None
        if self._fallback is not None:
            self._fallback.disarm()

    @contextlib.contextmanager
    def held(self, until: float, period_s: float = 0.5) -> Any:
        """A slow phase (an evaluation, a save): the loop makes no step, but the rank is working, so a thread
        marks progress every ``period_s`` up to ``until`` (monotonic seconds: the job's checkpoint timeout,
        the bound the control plane and ft_launcher give such a phase). Without it the in-process layer's
        soft timeout (5 s from the last step) took any longer phase for a hang and restarted the job's
        ranks. A phase still running at ``until`` is left to the timeouts."""
        stop = threading.Event()

        def mark() -> None:
            while not stop.wait(period_s) and time.monotonic() < until:
                self.tick()

        thread = threading.Thread(target=mark, name="unbroken-phase", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()

    def stop(self) -> None:
        self.disarm()
        if self._fallback is not None:
            self._fallback.stop()
