"""The in-process layer's finalize never waits on a stuck checkpoint past its budget."""

import threading
import time

from trainer.resilience import settle_checkpoint


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
    from trainer.resilience import PacedPing

    pacer, scope = PacedPing(period_s=0.05), Scope()
    pacer.arm(scope)
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
        pacer.arm(fresh)
        pacer.tick()
        time.sleep(0.2)
        assert len(fresh.pings) == 1 and len(scope.pings) == hung
    finally:
        pacer.stop()
