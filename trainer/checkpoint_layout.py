"""Where a checkpoint lives and when it counts: ``<root>/step_<N>/``, durable only with its ``COMMITTED``
marker (``trainer.checkpoint`` writes it after every shard and ``.metadata``), and the iteration file
ft_launcher reads for its no-progress check."""

from __future__ import annotations

import contextlib
import os
import re

from trainer.nvrx_compat import ITERATION_FILE

COMMITTED = "COMMITTED"
_STEP_DIR = re.compile(r"step_(\d+)")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:09d}")


def list_checkpoints(root: str) -> list[tuple[int, str, bool]]:
    """(step, path, durable) for every ``step_*`` directory, oldest first."""
    out = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    for name in names:
        m = _STEP_DIR.fullmatch(name)
        if not m:
            continue
        path = os.path.join(root, name)
        durable = os.path.exists(os.path.join(path, ".metadata")) and os.path.exists(os.path.join(path, COMMITTED))
        out.append((int(m.group(1)), path, durable))
    return sorted(out)


def latest_durable(root: str) -> int | None:
    steps = [s for s, _, durable in list_checkpoints(root) if durable]
    return steps[-1] if steps else None


def write_iteration_file(root: str, step: int) -> None:
    """The newest durable step as text, replaced atomically: ft_launcher (NVRx 0.6+) reads it to tell a
    restart cycle that made progress from one that did not (``--max-no-progress-restarts``)."""
    tmp = os.path.join(root, f".{ITERATION_FILE}.tmp")
    with open(tmp, "w") as f:
        f.write(f"{step}\n")
    os.replace(tmp, os.path.join(root, ITERATION_FILE))


def dir_bytes(path: str) -> int:
    total = 0
    for name in os.listdir(path):
        with contextlib.suppress(OSError):
            total += os.path.getsize(os.path.join(path, name))
    return total
