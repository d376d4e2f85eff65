"""One injected failure, fired once per job by the rank it names, the way a real failure happens: no fault
drill, no fact recorded for the product; the control plane must attribute it from what each layer sees.

    MATRIX_FAIL=sigkill|exception|hang|sigkill_save|exit137  MATRIX_RANK=1  MATRIX_STEP=30
    MATRIX_MARK=/path/fired   (written, with the time, just before the failure: the benchmark's clock)
"""

import os
import signal
import time

KIND = os.environ.get("MATRIX_FAIL", "")
RANK = int(os.environ.get("MATRIX_RANK", "0"))
STEP = int(os.environ.get("MATRIX_STEP", "0"))
MARK = os.environ.get("MATRIX_MARK", "")


def _claim(rank: int, kinds: tuple[str, ...]) -> bool:
    if KIND not in kinds or rank != RANK or not MARK or os.path.exists(MARK):
        return False
    with open(MARK, "w") as f:
        f.write(f"{time.time()}\n")
        f.flush()
        os.fsync(f.fileno())
    return True


def at_step(step: int, rank: int) -> None:
    """After a completed step: fail here if this is the injected rank and step."""
    if step < STEP or not _claim(rank, ("sigkill", "exception", "hang", "exit137")):
        return
    if KIND == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if KIND == "exit137":
        os._exit(137)  # how a shell or a container reports a process the OOM killer ended
    if KIND == "exception":
        raise ValueError(f"matrix: injected on rank {rank} at step {step}")
    while True:  # a hang: the interpreter runs, the step does not move
        time.sleep(0.05)


def during_save(step: int, rank: int) -> None:
    """In a save (Level 0/1: as it starts, so its peers write their part and wait for this rank's, leaving
    the step's directory without its metadata: a torn save; Level 2: while the async save writes)."""
    if step < STEP or not _claim(rank, ("sigkill_save",)):
        return
    os.kill(os.getpid(), signal.SIGKILL)
