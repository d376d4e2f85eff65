"""The in-process layer's finalize never waits on a stuck checkpoint past its budget; its hooks release
the logging locks an asynchronous restart left held."""

import contextlib
import ctypes
import io
import logging
import threading
import time
from typing import Iterator

from trainer.resilience import release_leaked_logging_locks, settle_checkpoint


class StuckSave:
    """A checkpointer whose in-flight save never ends (its collective lost its peer)."""

    def __init__(self, block: bool):
        self.block = block
        self.closed = threading.Event()
        self.release = threading.Event()

    def abandon(self, timeout_s: float) -> None:
        if self.block:
            self.release.wait()

    def close(self) -> None:
        self.closed.set()


def test_it_gives_up_waiting_after_its_budget():
    ckpt = StuckSave(block=True)
    t0 = time.monotonic()
    settle_checkpoint(ckpt, budget_s=0.2)
    assert 1.1 <= time.monotonic() - t0 < 3.0
    assert not ckpt.closed.is_set()
    ckpt.release.set()  # the save ends later: the background settle still closes the stager
    assert ckpt.closed.wait(2.0)


def test_it_settles_and_closes_a_save_that_ends():
    ckpt = StuckSave(block=False)
    t0 = time.monotonic()
    settle_checkpoint(ckpt, budget_s=5.0)
    assert time.monotonic() - t0 < 1.0
    assert ckpt.closed.is_set()


class Scope:
    """Stands in for NVRx's CallWrapper: records when its ``ping`` was called."""

    def __init__(self):
        self.pings: list[float] = []

    def ping(self) -> None:
        self.pings.append(time.monotonic())


def test_progress_pings_follow_the_loops_progress_and_stop_between_attempts():
    from trainer.liveness import Pacer

    pacer, scope = Pacer(period_s=0.05), Scope()
    pacer.arm(scope.ping)
    try:
        for _ in range(10):  # a loop making progress: pinged about every period
            pacer.tick()
            time.sleep(0.03)
        progressing = len(scope.pings)
        assert 3 <= progressing <= 8, scope.pings
        time.sleep(0.3)  # a hung loop: no progress, no ping
        assert len(scope.pings) <= progressing + 1
        hung = len(scope.pings)
        pacer.disarm()  # between attempts: progress pings nobody
        pacer.tick()
        time.sleep(0.2)
        assert len(scope.pings) == hung
        fresh = Scope()  # the next attempt's scope gets the pings
        pacer.arm(fresh.ping)
        pacer.tick()
        time.sleep(0.2)
        assert len(fresh.pings) == 1 and len(scope.pings) == hung
    finally:
        pacer.stop()


def test_a_stopped_pacer_armed_again_sends_again():
    """An in-process restart's finalize stops the ft_launcher heartbeats and the next attempt starts them:
    they must flow again, or ft_launcher's heartbeat timeout no longer sees a hang after the first
    in-process restart."""
    from trainer.liveness import Pacer

    pacer, first, second = Pacer(period_s=0.05), Scope(), Scope()
    pacer.arm(first.ping)
    try:
        pacer.tick()
        time.sleep(0.2)
        assert len(first.pings) == 1
        pacer.stop()
        pacer.tick()
        time.sleep(0.2)
        assert len(first.pings) == 1  # stopped: nothing sent
        pacer.arm(second.ping)
        for _ in range(4):
            pacer.tick()
            time.sleep(0.08)
        assert len(second.pings) >= 2 and len(first.pings) == 1, (first.pings, second.pings)
        assert sum(t.name == "unbroken-pacer" for t in threading.enumerate()) == 1  # the old thread ended
    finally:
        pacer.stop()


class Interrupt(BaseException):
    """What NVRx raises into the main thread (RankShouldRestart is a BaseException too)."""


def _raise_in(thread: threading.Thread, exc: type[BaseException]) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(exc))


@contextlib.contextmanager
def _own_logger(name: str) -> Iterator[tuple[logging.Logger, logging.Handler]]:
    handler = logging.StreamHandler(io.StringIO())
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        yield logger, handler
    finally:
        logger.removeHandler(handler)


def _logs_within(logger: logging.Logger, timeout_s: float) -> bool:
    t = threading.Thread(target=logger.info, args=("from another thread",), daemon=True)
    t.start()
    t.join(timeout_s)
    return not t.is_alive()


def test_an_asynchronous_restart_inside_a_log_call_leaks_its_lock_and_the_hook_releases_it():
    """The race behind an in-process restart that hung until the hard timeout: the restart exception lands
    as a log call releases its handler's lock; the lock stays with the interrupted thread, and the next
    Abort (another thread) waits on it. The hooks release it on the interrupted thread."""
    seen: list[tuple[bool, int]] = []
    with _own_logger("test-leak") as (logger, handler):

        def loop() -> None:
            try:
                while True:
                    logger.info("step %s", 1)
            except Interrupt:
                seen.append((handler.lock._is_owned(), release_leaked_logging_locks()))

        for _ in range(5000):
            t = threading.Thread(target=loop)
            t.start()
            time.sleep(0.0005)
            _raise_in(t, Interrupt)
            t.join()
            assert not handler.lock._is_owned()
            if seen[-1][0]:
                break
        leaked = [released for owned, released in seen if owned]
        assert leaked, f"no interrupted log call left its lock held in {len(seen)} tries"
        assert leaked[0] >= 1
        assert all(released == 0 for owned, released in seen if not owned)
        assert _logs_within(logger, 2.0)  # the lock is free: another thread logs


def test_a_lock_left_held_blocks_other_threads_until_released():
    with _own_logger("test-held") as (logger, handler):
        handler.acquire()  # as an interrupted release() leaves it
        handler.acquire()
        assert not _logs_within(logger, 0.3)
        assert release_leaked_logging_locks() == 2
        assert _logs_within(logger, 2.0)
        assert release_leaked_logging_locks() == 0


class _Timestamp:
    manual = None


class _Watchdog:
    """Stands in for NVRx's ProgressWatchdog: its thread sends ``timestamp`` to the monitor process."""

    def __init__(self):
        self.timestamp = _Timestamp()


class WatchedScope(Scope):
    def __init__(self):
        super().__init__()
        self.progress_watchdog = _Watchdog()


def test_progress_marks_write_the_time_of_the_loops_progress_for_nvrxs_watchdog_to_send():
    from trainer.liveness import NoRestart, ProgressMark

    mark, scope = ProgressMark(fallback_period_s=0.05), WatchedScope()
    try:
        mark.arm(scope)
        before = time.monotonic()
        mark.tick()
        stamped = scope.progress_watchdog.timestamp.manual
        assert stamped is not None and before <= stamped <= time.monotonic()
        time.sleep(0.2)
        assert scope.progress_watchdog.timestamp.manual == stamped  # no progress: the time stays
        assert scope.pings == []  # nothing sent of ours: NVRx's watchdog thread sends the timestamp
        mark.disarm()  # between attempts: the loop's progress marks nobody
        mark.tick()
        assert scope.progress_watchdog.timestamp.manual == stamped
        scope.progress_watchdog.timestamp = _Timestamp()  # the Wrapper resets it for the next attempt
        mark.arm(scope)
        mark.tick()
        assert scope.progress_watchdog.timestamp.manual > stamped

        older = Scope()  # an NVRx whose CallWrapper has no progress watchdog: pinged from a thread
        mark.arm(older)
        mark.tick()
        time.sleep(0.2)
        assert len(older.pings) == 1
        mark.disarm()
        mark.arm(NoRestart())  # in-process restart off: nothing to mark, nothing sent
        mark.tick()
    finally:
        mark.stop()
