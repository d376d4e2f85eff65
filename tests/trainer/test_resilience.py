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
