"""Sharded checkpoints with torch.distributed.checkpoint (DCP): every rank writes its own shard.

A checkpoint ``step_<N>/`` is *durable* only when every shard and ``.metadata`` are written (rank 0's
save future completes after it has gathered every rank's write result and written ``.metadata``) and
rank 0 has placed the ``COMMITTED`` marker. Anything else is torn and never loaded.

Async saves run on their own gloo process group (sharing FSDP's group deadlocks: the DCP thread's
collectives interleave with FSDP's), with the THREAD executor and one persistent stager whose staging
runs in the background; ``maybe_wait_for_staging()`` runs right before ``optimizer.step()`` because the
step is what mutates the tensors being copied. At most one save is in flight.

The staged host copy of the newest async save is also kept in memory (``MemorySnapshot``, one per
process, so it outlives an in-process restart): ``load`` restores from it instead of the disk when
every rank holds a complete snapshot of the same step and no durable checkpoint is newer. A snapshot
is complete once its staging finished; while the next save is staging (the stager reuses its
buffers) there is none, and the load falls back to the newest durable checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ContextManager

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from trainer.nvrx_compat import ITERATION_FILE
from trainer.wire import CheckpointMode, CheckpointState, EventKind, RestoredFrom

log = logging.getLogger(__name__)

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


def _copy_into(dst: Any, src: Any) -> Any:
    """``src`` (a snapshot, left untouched) copied into ``dst`` (a fresh state dict of the same
    shape, its tensors the live ones): tensors in place, everything else as a deep copy."""
    if isinstance(src, dict):
        out = dst if isinstance(dst, dict) else {}
        for k, v in src.items():
            out[k] = _copy_into(out.get(k), v)
        return out
    if isinstance(src, (list, tuple)):
        olds = list(dst) if isinstance(dst, (list, tuple)) and len(dst) == len(src) else [None] * len(src)
        items = [_copy_into(d, v) for d, v in zip(olds, src)]
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


def _snapshot_stager(memory: MemorySnapshot | None) -> Any:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    class SnapshotStager(DefaultStager):
        """The async save's stager; a finished staging becomes the rank's memory snapshot."""

        step: int | None = None

        def stage(self, state_dict: Any, **kwargs: Any) -> Any:
            if memory is None:
                return super().stage(state_dict, **kwargs)
            memory.staging()
            step = self.step
            fut = super().stage(state_dict, **kwargs)

            def done(f: Any) -> None:
                if step is not None and f.exception() is None:
                    memory.staged(step, f.result())
            fut.add_done_callback(done)
            return fut

    # CPU: no pinned/shared memory, no non-blocking copies (they need an accelerator). Staging runs in
    # the background and overlaps the next forward/backward.
    return SnapshotStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                         use_async_staging=True, use_non_blocking_copy=False))


@dataclass(slots=True)
class _InFlight:
    step: int
    response: Any  # AsyncSaveResponse (staging_completion, upload_completion) or a Future
    started_at: float
    blocking_s: float
    staged: bool


class Checkpointer:
    """Save/load/commit/GC of DCP checkpoints under ``root``. Rank 0 commits, collects and reports."""

    def __init__(self, *, root: str, mode: CheckpointMode, keep: int, pg: Any, report: Callable[..., None],
                 atomic: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
                 memory: MemorySnapshot | None = None):
        self.root, self.mode, self.keep, self.pg, self.memory = root, mode, keep, pg, memory
        self.restored_from: RestoredFrom | None = None  # where the last load came from
        self.rank = dist.get_rank(pg)
        self._report, self._atomic = report, atomic
        self._in_flight: _InFlight | None = None
        self._stager: Any = None
        os.makedirs(root, exist_ok=True)

    # -- load ---------------------------------------------------------------------------------------

    def load(self, state: Stateful) -> int | None:
        """Restore ``state`` from the memory snapshot or the newest durable checkpoint; return its step
        (None: fresh start). ``restored_from`` says which.

        Rank 0 chooses the durable one (so every rank loads the same one even if a listing races a
        commit) and also reports and removes torn checkpoints left by a restart: they were abandoned,
        never loaded. One gather of (snapshot step, rank 0's choice) lets every rank agree: memory only
        when every rank's snapshot has the same step, at least the durable one's.
        """
        self.restored_from = None
        durable: int | None = None
        if self.rank == 0:
            durable = latest_durable(self.root)
            for step, path, ok in list_checkpoints(self.root):
                if not ok and (durable is None or step > durable):
                    self._emit(step=step, mode=None, state=CheckpointState.ABANDONED, detail="torn by a restart")
                    shutil.rmtree(path, ignore_errors=True)
        snap_step, snap = self.memory.get() if self.memory is not None else (None, None)
        views: list[Any] = [None] * dist.get_world_size(self.pg)
        dist.all_gather_object(views, (snap_step, durable), group=self.pg)
        durable = views[0][1]
        steps = {v[0] for v in views}
        mem_step = steps.pop() if len(steps) == 1 else None
        if mem_step is not None and snap is not None and (durable is None or mem_step >= durable):
            target = {"app": state.state_dict()}
            state.load_state_dict(_copy_into(target, snap)["app"])
            self.restored_from = RestoredFrom.MEMORY
            return state.step
        if durable is None:
            return None
        dcp.load({"app": state}, checkpoint_id=step_dir(self.root, durable), process_group=self.pg)
        self.restored_from = RestoredFrom.DISK
        return state.step

    # -- save ---------------------------------------------------------------------------------------

    def save(self, state: Stateful, step: int, *, mode: CheckpointMode | None = None) -> None:
        mode = mode or self.mode
        self.wait()  # at most one save in flight
        state.step = step
        path = step_dir(self.root, step)
        t0 = time.perf_counter()
        if mode == CheckpointMode.SYNC:
            dcp.save({"app": state}, checkpoint_id=path, process_group=self.pg)
            blocking = time.perf_counter() - t0
            self._commit(step, mode, blocking_s=blocking, write_s=blocking)
            return
        stager = self._get_stager()
        stager.step = step
        resp = dcp.async_save({"app": state}, checkpoint_id=path, process_group=self.pg, async_stager=stager)
        blocking = time.perf_counter() - t0
        self._in_flight = _InFlight(step=step, response=resp, started_at=t0, blocking_s=blocking,
                                    staged=not hasattr(resp, "staging_completion"))
        self._emit(step=step, mode=mode, state=CheckpointState.IN_FLIGHT, blocking_s=round(blocking, 6))

    def maybe_wait_for_staging(self) -> None:
        """Right before ``optimizer.step()``: the staging copy must finish before the step mutates state."""
        f = self._in_flight
        if f is None or f.staged:
            return
        t0 = time.perf_counter()
        f.response.staging_completion.result()
        f.blocking_s += time.perf_counter() - t0
        f.staged = True

    def poll(self) -> None:
        """Commit the in-flight save if it is done; never blocks."""
        f = self._in_flight
        if f is not None and _upload(f.response).done():
            self.wait()

    def wait(self) -> None:
        """Finish the in-flight save (if any) and commit it."""
        f = self._in_flight
        if f is None:
            return
        self.maybe_wait_for_staging()
        self._in_flight = None
        try:
            _upload(f.response).result()
        except Exception as e:
            self._emit(step=f.step, mode=CheckpointMode.ASYNC, state=CheckpointState.FAILED,
                       detail=repr(e)[:500])
            raise
        self._commit(f.step, CheckpointMode.ASYNC, blocking_s=f.blocking_s,
                     write_s=time.perf_counter() - f.started_at)

    def abandon(self, timeout_s: float = 10.0) -> None:
        """After a fault (process groups aborted): let the in-flight save end, commit it only if it
        completed; otherwise report it abandoned. Never raises."""
        f = self._in_flight
        self._in_flight = None
        if f is None:
            return
        try:
            _upload(f.response).result(timeout=timeout_s)
        except Exception as e:
            self._emit(step=f.step, mode=CheckpointMode.ASYNC, state=CheckpointState.ABANDONED,
                       detail=f"restart: {e!r}"[:500])
            return
        with contextlib.suppress(Exception):
            self._commit(f.step, CheckpointMode.ASYNC, blocking_s=f.blocking_s,
                         write_s=time.perf_counter() - f.started_at)

    def close(self) -> None:
        if self._stager is not None:
            with contextlib.suppress(Exception):
                self._stager.close()
            self._stager = None

    # -- internals ----------------------------------------------------------------------------------

    def _get_stager(self) -> Any:
        if self._stager is None:
            self._stager = _snapshot_stager(self.memory)
        return self._stager

    def _commit(self, step: int, mode: CheckpointMode, *, blocking_s: float, write_s: float) -> None:
        if self.rank != 0:
            return
        path = step_dir(self.root, step)
        # Inside atomic(): an in-process restart cannot interleave with placing the marker.
        with self._atomic():
            with open(os.path.join(path, COMMITTED), "w") as f:
                f.write(f"{time.time()}\n")
                f.flush()
                os.fsync(f.fileno())
        write_iteration_file(self.root, step)
        self._emit(step=step, mode=mode, state=CheckpointState.DURABLE, blocking_s=round(blocking_s, 6),
                   write_s=round(write_s, 6), bytes=dir_bytes(path))
        self._gc()

    def _gc(self) -> None:
        """Keep the newest ``keep`` durable checkpoints; drop older ones and torn ones older than them."""
        ckpts = list_checkpoints(self.root)
        durable = [s for s, _, d in ckpts if d]
        if not durable:
            return
        keep_from = durable[-self.keep] if len(durable) >= self.keep else durable[0]
        for step, path, _ in ckpts:
            if step < keep_from:
                shutil.rmtree(path, ignore_errors=True)

    def _emit(self, **data: Any) -> None:
        if self.rank == 0:
            self._report(EventKind.CHECKPOINT, {k: v for k, v in data.items() if v is not None})


def _upload(resp: Any) -> Any:
    return getattr(resp, "upload_completion", resp)
