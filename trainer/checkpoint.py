"""Sharded checkpoints with torch.distributed.checkpoint (DCP): every rank writes its own shard.

A checkpoint ``step_<N>/`` is *durable* only when every shard and ``.metadata`` are written (rank 0's
save future completes after it has gathered every rank's write result and written ``.metadata``) and
rank 0 has placed the ``COMMITTED`` marker. Anything else is torn and never loaded.

Async saves run on their own gloo process group (sharing FSDP's group deadlocks: the DCP thread's
collectives interleave with FSDP's), with the THREAD executor and one persistent stager whose staging
runs in the background; ``maybe_wait_for_staging()`` runs right before ``optimizer.step()`` because the
step is what mutates the tensors being copied. At most one save is in flight.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ContextManager

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from trainer.wire import CheckpointMode, CheckpointState, EventKind

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


def dir_bytes(path: str) -> int:
    total = 0
    for name in os.listdir(path):
        with contextlib.suppress(OSError):
            total += os.path.getsize(os.path.join(path, name))
    return total


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
                 section: Callable[[str], ContextManager[Any]] = lambda name: contextlib.nullcontext()):
        self.root, self.mode, self.keep, self.pg = root, mode, keep, pg
        self.rank = dist.get_rank(pg)
        self._report, self._atomic, self._section = report, atomic, section
        self._in_flight: _InFlight | None = None
        self._stager: Any = None
        os.makedirs(root, exist_ok=True)

    # -- load ---------------------------------------------------------------------------------------

    def load(self, state: Stateful) -> int | None:
        """Load the newest durable checkpoint into ``state``; return its step (None: fresh start).

        Rank 0 chooses (so every rank loads the same one even if a listing races a commit) and also
        reports and removes torn checkpoints left by a restart: they were abandoned, never loaded.
        """
        choice: list[int | None] = [None]
        if self.rank == 0:
            choice[0] = latest_durable(self.root)
            for step, path, durable in list_checkpoints(self.root):
                if not durable and (choice[0] is None or step > choice[0]):
                    self._emit(step=step, mode=None, state=CheckpointState.ABANDONED, detail="torn by a restart")
                    shutil.rmtree(path, ignore_errors=True)
        dist.broadcast_object_list(choice, src=0, group=self.pg)
        step = choice[0]
        if step is None:
            return None
        with self._section("checkpoint"):
            dcp.load({"app": state}, checkpoint_id=step_dir(self.root, step), process_group=self.pg)
        return state.step

    # -- save ---------------------------------------------------------------------------------------

    def save(self, state: Stateful, step: int, *, mode: CheckpointMode | None = None) -> None:
        mode = mode or self.mode
        self.wait()  # at most one save in flight
        state.step = step
        path = step_dir(self.root, step)
        t0 = time.perf_counter()
        with self._section("checkpoint"):
            if mode == CheckpointMode.SYNC:
                dcp.save({"app": state}, checkpoint_id=path, process_group=self.pg)
                blocking = time.perf_counter() - t0
                self._commit(step, mode, blocking_s=blocking, write_s=blocking)
                return
            resp = dcp.async_save({"app": state}, checkpoint_id=path, process_group=self.pg,
                                  async_stager=self._get_stager())
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
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            # CPU: no pinned/shared memory, no non-blocking copies (they need an accelerator). Staging
            # runs in the background and overlaps the next forward/backward.
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                        use_async_staging=True, use_non_blocking_copy=False))
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
