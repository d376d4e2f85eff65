"""The copies of a rank's newest save that restore faster than the durable checkpoint: the staged copy in
host memory (``MemorySnapshot``, one per process, so it outlives an in-process restart) and the node-local
copy (``LocalCopy``: shared memory or a local disk, for the new processes of an in-job restart). See
``trainer.checkpoint`` for when each is used."""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import re
import shutil
import threading
from typing import Any

import torch
from torch.distributed.tensor import DTensor

log = logging.getLogger("trainer.checkpoint")  # one logger for the checkpoint modules, as before the split


class MemorySnapshot:
    """This rank's newest complete staged copy of the state (host memory), with its step. Written by
    the staging thread, read by ``Checkpointer.load``; one per process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._step: int | None = None
        self._state: dict[str, Any] | None = None

    def staging(self) -> None:
        """A save starts staging: the stager may overwrite the buffers the snapshot lives in."""
        with self._lock:
            self._step, self._state = None, None

    def staged(self, step: int, state_dict: dict[str, Any]) -> None:
        with self._lock:
            self._step, self._state = step, state_dict

    def get(self) -> tuple[int | None, dict[str, Any] | None]:
        with self._lock:
            return self._step, self._state


_LOCAL_FILE = re.compile(r"step_(\d+)\.w(\d+)\.pt")


def _local_tree(x: Any) -> Any:
    """A staged state dict with every DTensor replaced by its local shard (what this rank restores)."""
    if isinstance(x, dict):
        return {k: _local_tree(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        items = [_local_tree(v) for v in x]
        return type(x)(items) if isinstance(x, tuple) else items
    if isinstance(x, DTensor):
        return x.to_local()
    return x


def _tensor_bytes(x: Any) -> int:
    if isinstance(x, dict):
        return sum(_tensor_bytes(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(v) for v in x)
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return 0


class LocalCopy:
    """This rank's copy of its newest durable async save in a node-local directory, for the new
    processes of an in-job restart on the same node. One file per step (``step_<N>.w<world>.pt``),
    written under a temporary name and renamed, so a file that exists is complete; only the newest
    is kept. No fsync: the copy only has to outlive the processes, not the node (the page cache does).
    A copy that would not fit (free space under its size plus the one it replaces) is skipped, once
    said in the log, and restarts read the durable checkpoint."""

    def __init__(self, root: str, *, rank: int, world: int):
        self.dir, self.rank, self.world = os.path.join(root, f"rank{rank}"), rank, world
        os.makedirs(self.dir, exist_ok=True)
        self._warned = False

    def _path(self, step: int) -> str:
        return os.path.join(self.dir, f"step_{step:09d}.w{self.world}.pt")

    def newest(self) -> int | None:
        """The newest step this rank holds a copy of (for this world size), or None."""
        steps = []
        with contextlib.suppress(OSError):
            for name in os.listdir(self.dir):
                m = _LOCAL_FILE.fullmatch(name)
                if m and int(m.group(2)) == self.world:
                    steps.append(int(m.group(1)))
        return max(steps) if steps else None

    def write(self, step: int, staged: dict[str, Any]) -> bool:
        """Copy ``staged`` (the save's staged state dict) as this rank's copy of ``step``; drop older
        copies. False (and nothing written) when it would not fit; raises only on a write error."""
        local = _local_tree(staged)
        need = _tensor_bytes(local)
        old = [os.path.join(self.dir, n) for n in os.listdir(self.dir) if n != os.path.basename(self._path(step))]
        room = shutil.disk_usage(self.dir).free + sum(os.path.getsize(p) for p in old if os.path.isfile(p))
        if need * 1.05 + (1 << 20) > room:
            for p in old:  # an older copy must not be mistaken for the newest one
                with contextlib.suppress(OSError):
                    os.remove(p)
            if not self._warned:
                log.warning("node-local checkpoint copy skipped: %d MB needed, %d MB free in %s; in-job restarts "
                            "will read the durable checkpoint", need >> 20, room >> 20, self.dir)
                self._warned = True
            return False
        for p in old:  # first: the new copy needs their room
            with contextlib.suppress(OSError):
                os.remove(p)
        tmp = self._path(step) + ".tmp"
        try:
            torch.save(local, tmp)
            os.replace(tmp, self._path(step))
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
        return True

    def read(self, step: int) -> dict[str, Any]:
        return torch.load(self._path(step), map_location="cpu", weights_only=False, mmap=True)


def copy_into(dst: Any, src: Any) -> Any:
    """``src`` (a snapshot, left untouched) copied into ``dst`` (a fresh state dict of the same
    shape, its tensors the live ones): tensors in place, everything else as a deep copy."""
    if isinstance(src, dict):
        out = dst if isinstance(dst, dict) else {}
        for k, v in src.items():
            out[k] = copy_into(out.get(k), v)
        return out
    if isinstance(src, (list, tuple)):
        olds = list(dst) if isinstance(dst, (list, tuple)) and len(dst) == len(src) else [None] * len(src)
        items = [copy_into(d, v) for d, v in zip(olds, src, strict=True)]
        return type(src)(items) if isinstance(src, tuple) else items
    if isinstance(src, torch.Tensor):
        local = src.to_local() if isinstance(src, DTensor) else src
        if isinstance(dst, torch.Tensor):
            target = dst.to_local() if isinstance(dst, DTensor) else dst
            if target.shape == local.shape:
                target.copy_(local)
                return dst
        return local.clone()
    return copy.deepcopy(src)
