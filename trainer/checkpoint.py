"""Sharded checkpoints with torch.distributed.checkpoint (DCP): every rank writes its own shard.

A checkpoint ``step_<N>/`` is *durable* only when every shard and ``.metadata`` are written (rank 0's
save future completes after it has gathered every rank's write result and written ``.metadata``) and
rank 0 has placed the ``COMMITTED`` marker. Anything else is torn and never loaded.

Async saves run on their own gloo process group (sharing FSDP's group deadlocks: the DCP thread's
collectives interleave with FSDP's), with one persistent stager whose staging runs in the background;
``maybe_wait_for_staging()`` runs right before ``optimizer.step()`` because the step is what mutates
the tensors being copied. DCP's save itself runs in its THREAD executor, or in the rank's saver
process (below) with ``UNBROKEN_CKPT_SAVER=process``. At most one save is in flight.

Each save reports what it cost the loop: ``blocking_s`` (the loop waited: the save call, the staging
wait, a wait for the previous save) and, for async saves, ``interference_s``: the extra time of the
steps that overlapped it against the median of the steps just before it (step boundaries are the
``poll`` calls, one per step).

The staged host copy of the newest async save is also kept in memory (``MemorySnapshot``, one per
process, so it outlives an in-process restart): ``load`` restores from it instead of the disk when
every rank holds a complete snapshot of the same step and no durable checkpoint is newer. A snapshot
is complete once its staging finished; while the next save is staging (the stager reuses its
buffers) there is none, and the load falls back to the newest durable checkpoint.

With a node-local directory (``LocalCopy``: shared memory or a local disk), each rank also keeps a copy
of its newest durable async save there, written from the staged copy by the writer thread after the
save is durable. New processes on the same node (an in-job restart) restore from it instead of the
durable checkpoint (a network volume on Kubernetes) when every rank finds its own copy of the same
step, at least the durable one's; otherwise from the durable checkpoint.

The directory layout is ``trainer.checkpoint_layout``'s, the memory snapshot and the node-local copy
``trainer.checkpoint_copies``', the saver process ``trainer.checkpoint_saver``'s.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ContextManager

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from trainer.checkpoint_copies import LocalCopy, MemorySnapshot, copy_into
from trainer.checkpoint_layout import (
    COMMITTED,
    dir_bytes,
    list_checkpoints,
    step_dir,
    write_iteration_file,
)
from trainer.checkpoint_saver import saver_alive, saver_process_available, start_saver, stop_saver
from trainer.wire import CheckpointMode, CheckpointState, EventKind, RestoredFrom

log = logging.getLogger(__name__)


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer, writing each tensor without the zip CRC-32 that ``torch.save`` computes:
    ``torch.load`` never checks it (a corrupted tensor loads without error either way), and computing
    it reads every byte of the state once more per save: ~15 % of a save's CPU, and memory traffic that
    slows the steps an async save overlaps (make bench-checkpoint). torch's switch is per thread
    (context-local), so it is set only around the write, in the thread that writes."""

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """DCP's async executor runs the save later, in its own thread: if a restart's abort destroyed the
        process groups in between, DCP would save as a single process (this rank's shards and a
        ``.metadata`` naming only them, which rank 0 would make durable: every later restore fails with
        "Missing key ... rank1"). Fail instead: the save is abandoned and nothing is made durable."""
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("unbroken: the process group is gone (a restart aborted it): checkpoint not written")
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)

    def write_data(self, plan: Any, planner: Any) -> Any:
        get = getattr(torch.serialization, "get_crc32_options", None)
        if get is None:  # a torch without the switch: checksums as before
            return super().write_data(plan, planner)
        before = get()
        torch.serialization.set_crc32_options(False)
        try:
            return super().write_data(plan, planner)  # writes before it returns (a completed future)
        finally:
            torch.serialization.set_crc32_options(before)


def _snapshot_stager(memory: MemorySnapshot | None, *, shared: bool = False) -> Any:
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

    # CPU: no pinned memory, no non-blocking copies (they need an accelerator); shared memory for the
    # saver process (allocated once: the stager reuses its buffers). Staging runs in the background
    # and overlaps the next forward/backward.
    return SnapshotStager(StagingOptions(use_pinned_memory=False, use_shared_memory=shared,
                                         use_async_staging=True, use_non_blocking_copy=False))


@dataclass(slots=True)
class _InFlight:
    step: int
    response: Any  # AsyncSaveResponse (staging_completion, upload_completion) or a Future
    started_at: float
    blocking_s: float
    staged: bool
    baseline_s: float | None = None  # the median step time just before the save (None: not known)
    overlap_s: float = 0.0  # the steps that overlapped the save: their total time and number
    overlap_n: int = 0
    ended: threading.Event = field(default_factory=threading.Event)  # written, and made durable or failed
    error: BaseException | None = None  # the write's failure (or the commit's)
    write_s: float = 0.0  # from the save's start to durable (set with ``ended``)
    bytes: int | None = None  # the checkpoint's size on disk (rank 0)

    def interference_s(self) -> float | None:
        """The extra time of the steps that overlapped the save against the steps just before it,
        without what the loop blocked on the save (counted in ``blocking_s``)."""
        if self.baseline_s is None or not self.overlap_n:
            return None
        return max(0.0, self.overlap_s - self.overlap_n * self.baseline_s - self.blocking_s)


#: Step times (between ``poll`` calls) with no save in flight kept as the baseline of the next save.
BASELINE_STEPS = 5


class Checkpointer:
    """Save/load/commit/GC of DCP checkpoints under ``root``. Rank 0 commits, collects and reports."""

    def __init__(self, *, root: str, mode: CheckpointMode, keep: int, pg: Any, report: Callable[..., None],
                 atomic: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
                 memory: MemorySnapshot | None = None, saver: bool | None = None, local_dir: str = ""):
        self.root, self.mode, self.keep, self.pg, self.memory = root, mode, keep, pg, memory
        # Async saves in DCP's THREAD executor, or in the saver process (``UNBROKEN_CKPT_SAVER=process``
        # where this torch has one). Not the default: on a CPU-only node with as many ranks as cores it
        # costs the loop the same (make bench-checkpoint) and, at idle priority, it takes longer to
        # make a save durable while the steps keep the cores busy (more steps lost to a crash).
        if saver is None:
            choice = os.environ.get("UNBROKEN_CKPT_SAVER", "thread")
            if choice not in ("thread", "process"):
                raise ValueError(f"UNBROKEN_CKPT_SAVER={choice!r}: expected thread or process")
            saver = choice == "process"
        # (PR_SET_PDEATHSIG follows the thread that starts the saver: only the main thread does.)
        self.saver = (bool(saver) and saver_process_available()
                      and threading.current_thread() is threading.main_thread())
        self._had_saver = False  # this rank's saver was running: if it is gone, it died
        self.restored_from: RestoredFrom | None = None  # where the last load came from
        self.rank = dist.get_rank(pg)
        # The node-local copy needs the staged copy (the memory snapshot) to copy from.
        self.local: LocalCopy | None = None
        if local_dir and memory is not None:
            try:
                self.local = LocalCopy(local_dir, rank=dist.get_rank(), world=dist.get_world_size())
            except OSError as e:  # no such directory can be made here: durable checkpoints only
                log.warning("node-local checkpoint copies off: cannot use %s (%s)", local_dir, e.strerror or e)
        self._report, self._atomic = report, atomic
        self._in_flight: _InFlight | None = None
        self._stager: Any = None
        self._last_tick: float | None = None  # the previous poll (a step boundary)
        self._clean: collections.deque[float] = collections.deque(maxlen=BASELINE_STEPS)
        self._tainted = False  # the current step blocked on a sync save: not a baseline step
        os.makedirs(root, exist_ok=True)

    # -- load ---------------------------------------------------------------------------------------

    def load(self, state: Stateful) -> int | None:
        """Restore ``state`` from the memory snapshot or the newest durable checkpoint; return its step
        (None: fresh start). ``restored_from`` says which.

        Rank 0 chooses the durable one (so every rank loads the same one even if a listing races a
        commit) and also reports and removes torn checkpoints left by a restart: they were abandoned,
        never loaded. One gather of (snapshot step, rank 0's choice, saver alive, node-local copy's
        step) lets every rank agree: memory only when every rank's snapshot has the same step, at
        least the durable one's; else the node-local copies on the same terms (and a second gather:
        every rank read its copy); else the durable checkpoint.
        """
        self.restored_from = None
        durables: list[int] = []  # rank 0's durable steps, newest first
        if self.rank == 0:
            ckpts = list_checkpoints(self.root)
            durables = [s for s, _, ok in reversed(ckpts) if ok]
            for step, path, ok in ckpts:
                if not ok and (not durables or step > durables[0]):
                    self._emit(step=step, mode=None, state=CheckpointState.ABANDONED, detail="torn by a restart")
                    shutil.rmtree(path, ignore_errors=True)
        snap_step, snap = self.memory.get() if self.memory is not None else (None, None)
        views: list[Any] = [None] * dist.get_world_size(self.pg)
        saver_ok = self.saver and saver_alive()
        local_step = self.local.newest() if self.local is not None else None
        dist.all_gather_object(views, (snap_step, durables, saver_ok, local_step), group=self.pg)
        if self.saver:  # every rank keeps its saver, or every rank starts a new one at the next save
            if all(v[2] for v in views):
                self._had_saver = True
            else:
                stop_saver()
        durables = views[0][1]
        durable = durables[0] if durables else None
        steps = {v[0] for v in views}
        mem_step = steps.pop() if len(steps) == 1 else None
        if mem_step is not None and snap is not None and (durable is None or mem_step >= durable):
            target = {"app": state.state_dict()}
            state.load_state_dict(copy_into(target, snap)["app"])
            self.restored_from = RestoredFrom.MEMORY
            return state.step
        if self.local is not None and self._load_local(state, {v[3] for v in views}, durable):
            return state.step
        if durable is None:
            return None
        return self._load_durable(state, durables)

    def _load_durable(self, state: Stateful, durables: list[int]) -> int:
        """Load the newest durable checkpoint that DCP can load (``durables``: newest first). DCP fails a load
        on every rank of the group when one rank fails, so every rank moves on together. A checkpoint
        that is durable yet unloadable (a rank's part missing from its ``.metadata``, a shard gone) would
        otherwise fail every restart until the restart storm stops the job: an older one that loads wins,
        and the newer ones are set aside (renamed ``step_N.unloadable-<time>``, kept for a look, and
        reported failed). When none loads, the newest one's failure is raised and nothing is set aside:
        a model that no longer matches its checkpoints is not a reason to start from scratch."""
        failures: list[tuple[int, CheckpointException]] = []
        for step in durables:
            try:
                dcp.load({"app": state}, checkpoint_id=step_dir(self.root, step), process_group=self.pg)
            except CheckpointException as e:
                log.warning("checkpoint of step %d cannot be loaded (%r): trying an older one", step, e)
                failures.append((step, e))
                continue
            for bad, e in failures:
                self._set_aside(bad, e, loaded=step)
            self.restored_from = RestoredFrom.DISK
            return state.step
        raise failures[0][1]

    def _set_aside(self, step: int, error: CheckpointException, *, loaded: int) -> None:
        """Rank 0: rename an unloadable durable checkpoint out of the ``step_N`` namespace, point the
        iteration file at the one that loaded, and report it failed (an attempt of its own in the ledger)."""
        if self.rank != 0:
            return
        path, now = step_dir(self.root, step), int(time.time())
        aside = f"{path}.unloadable-{now}"
        with contextlib.suppress(OSError):
            os.replace(path, aside)
        write_iteration_file(self.root, loaded)
        self._emit(step=step, mode=None, state=CheckpointState.FAILED, attempt_key=f"unloadable-{now}",
                   detail=f"unloadable, set aside as {os.path.basename(aside)}; restored step {loaded} "
                          f"instead: {_failures_text(error)}"[:500])

    def _load_local(self, state: Stateful, steps: set[int | None], durable: int | None) -> bool:
        """Restore from the node-local copies when every rank holds one of the same step, at least the
        durable one's, and every rank read its own (one more gather); False: load from disk."""
        assert self.local is not None
        step = steps.pop() if len(steps) == 1 else None
        if step is None or (durable is not None and step < durable):
            return False
        copy_ = None
        try:
            copy_ = self.local.read(step)
        except Exception as e:  # noqa: BLE001 - every rank falls back to the durable checkpoint
            log.warning("node-local checkpoint copy of step %d unreadable (%r): loading the durable one", step, e)
        oks: list[Any] = [None] * dist.get_world_size(self.pg)
        dist.all_gather_object(oks, copy_ is not None, group=self.pg)
        if not all(oks):
            return False
        state.load_state_dict(copy_into({"app": state.state_dict()}, copy_)["app"])
        self.restored_from = RestoredFrom.LOCAL
        return True

    # -- save ---------------------------------------------------------------------------------------

    def save(self, state: Stateful, step: int, *, mode: CheckpointMode | None = None) -> None:
        mode = mode or self.mode
        if not dist.is_initialized():
            # A restart's abort destroyed the process groups between this rank's step and its save (NVRx
            # interrupts the main thread a moment after the abort). DCP would then save as a single process:
            # this rank's shards alone, made durable by rank 0 and unloadable by every restart after it.
            log.warning("checkpoint of step %d not saved: the process group is gone (a restart aborted it)", step)
            return
        t0 = time.perf_counter()  # waiting for the previous save is this one's blocking time
        self.wait()  # at most one save in flight
        state.step = step
        path = step_dir(self.root, step)
        if mode == CheckpointMode.SYNC:
            self._tainted = True
            dcp.save({"app": state}, checkpoint_id=path, storage_writer=_Writer(path), process_group=self.pg)
            blocking = time.perf_counter() - t0
            self._commit(step, mode, blocking_s=blocking, write_s=blocking)
            return
        stager = self._get_stager()
        stager.step = step
        kwargs: dict[str, Any] = {}
        if self.saver:
            if not saver_alive():
                if self._had_saver:
                    raise RuntimeError("unbroken: this rank's checkpoint saver process died")
                start_saver(self.pg)
            self._had_saver = True
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
            kwargs["async_checkpointer_type"] = AsyncCheckpointerType.PROCESS
        resp = dcp.async_save({"app": state}, checkpoint_id=path, storage_writer=_Writer(path),
                              process_group=self.pg, async_stager=stager,
                              **kwargs)
        blocking = time.perf_counter() - t0
        f = self._in_flight = _InFlight(step=step, response=resp, started_at=t0, blocking_s=blocking,
                                        staged=not hasattr(resp, "staging_completion"),
                                        baseline_s=statistics.median(self._clean) if self._clean else None)
        self._emit(step=step, mode=mode, state=CheckpointState.IN_FLIGHT, blocking_s=round(blocking, 6))
        _upload(resp).add_done_callback(lambda done, f=f: self._written(f, done))

    @property
    def in_flight(self) -> bool:
        """A save started and no step boundary (``poll``) has seen it end yet: the steps it overlaps."""
        return self._in_flight is not None

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
        """Once per step (a step boundary): time the step, and let go of the in-flight save once it
        ended (committed by ``_written``, off the loop); raise its failure. Never blocks, and makes no
        system call: on a node whose cores are all busy, one is where the step loses the core."""
        self._tick()
        f = self._in_flight
        if f is not None and f.ended.is_set():
            self._in_flight = None
            self._report_ended(f)

    def _tick(self) -> None:
        """A step ended: its time counts against the in-flight save (interference), or as a baseline
        step when nothing was in flight and it did not block on a sync save."""
        now = time.perf_counter()
        if self._last_tick is not None:
            dt = now - self._last_tick
            f = self._in_flight
            if f is not None:
                f.overlap_s += dt
                f.overlap_n += 1
            elif not self._tainted:
                self._clean.append(dt)
        self._last_tick, self._tainted = now, False

    def wait(self) -> None:
        """Finish the in-flight save (if any) and commit it. The time the loop waits here is blocking
        time (the next save waits for the previous one)."""
        f = self._in_flight
        if f is None:
            return
        self.maybe_wait_for_staging()
        self._in_flight = None
        if not f.ended.is_set():
            self._tainted = True  # the step that waited here is not a baseline step
            t0 = time.perf_counter()
            f.ended.wait()
            f.blocking_s += time.perf_counter() - t0
        self._report_ended(f)

    def _written(self, f: _InFlight, done: Any) -> None:
        """The save's write ended (DCP's executor thread, or the thread that collects the saver
        process's answer): make it durable here, off the training loop (an fsync, the iteration file,
        the old checkpoints' deletion). The marker needs no ``atomic()`` section: an in-process restart
        interrupts only the main thread. The loop reports it at its next step (``_report_ended``)."""
        try:
            done.result()
            f.bytes = self._make_durable(f.step, atomic=False)
        except BaseException as e:  # noqa: BLE001 - handed to the loop (poll/wait) or to abandon
            f.error = e
        else:
            self._copy_locally(f.step)
        finally:
            f.write_s = time.perf_counter() - f.started_at
            f.ended.set()

    def _copy_locally(self, step: int) -> None:
        """After a durable async save, on its writer thread: the node-local copy, from the staged copy
        (the next save's staging waits for this one to end, so the buffers still hold ``step``). A
        failure costs only the copy (restarts read the durable checkpoint)."""
        if self.local is None or self.memory is None:
            return
        snap_step, snap = self.memory.get()
        if snap_step != step or snap is None:
            return
        try:
            self.local.write(step, snap)
        except Exception as e:  # noqa: BLE001
            log.warning("node-local checkpoint copy of step %d failed: %r", step, e)

    def _report_ended(self, f: _InFlight) -> None:
        """On the loop: the ended save's event; its failure raised. Its interference counts the steps
        up to this one (the step in which the write ended overlapped it too)."""
        if f.error is not None:
            self._emit(step=f.step, mode=CheckpointMode.ASYNC, state=CheckpointState.FAILED,
                       detail=repr(f.error)[:500])
            raise f.error
        interference = f.interference_s()
        self._emit(step=f.step, mode=CheckpointMode.ASYNC, state=CheckpointState.DURABLE,
                   blocking_s=round(f.blocking_s, 6), write_s=round(f.write_s, 6), bytes=f.bytes,
                   interference_s=None if interference is None else round(interference, 6))

    def abandon(self, timeout_s: float = 10.0) -> None:
        """After a fault (process groups aborted): let the in-flight save end, commit it only if it
        completed; otherwise report it abandoned. Never raises."""
        f = self._in_flight
        self._in_flight = None
        if f is None:
            return
        if f.ended.wait(timeout_s) and f.error is None:  # ``_written`` made it durable
            self._emit(step=f.step, mode=CheckpointMode.ASYNC, state=CheckpointState.DURABLE,
                       blocking_s=round(f.blocking_s, 6), write_s=round(f.write_s, 6), bytes=f.bytes)
            return
        if self.saver:  # it may be stuck in the save (a peer rank never sent its part): end it
            stop_saver()
        why = f.error if f.error is not None else TimeoutError(f"still writing after {timeout_s} s")
        self._emit(step=f.step, mode=CheckpointMode.ASYNC, state=CheckpointState.ABANDONED,
                   detail=f"restart: {why!r}"[:500])

    def close(self) -> None:
        if self._stager is not None:
            with contextlib.suppress(Exception):
                self._stager.close()
            self._stager = None

    # -- internals ----------------------------------------------------------------------------------

    def _get_stager(self) -> Any:
        if self._stager is None:
            self._stager = _snapshot_stager(self.memory, shared=self.saver)
        return self._stager

    def _commit(self, step: int, mode: CheckpointMode, *, blocking_s: float, write_s: float) -> None:
        """A sync save, on the loop: make it durable and report it."""
        size = self._make_durable(step, atomic=True)
        self._emit(step=step, mode=mode, state=CheckpointState.DURABLE, blocking_s=round(blocking_s, 6),
                   write_s=round(write_s, 6), bytes=size)

    def _make_durable(self, step: int, *, atomic: bool) -> int | None:
        """Rank 0: the durable marker (fsynced), the iteration file, keep-K; the checkpoint's size."""
        if self.rank != 0:
            return None
        path = step_dir(self.root, step)
        # On the loop, inside atomic(): an in-process restart cannot interleave with placing the marker.
        with (self._atomic() if atomic else contextlib.nullcontext(),
              open(os.path.join(path, COMMITTED), "w") as f):
            f.write(f"{time.time()}\n")
            f.flush()
            os.fsync(f.fileno())
        write_iteration_file(self.root, step)
        size = dir_bytes(path)
        self._gc()
        return size

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


def _failures_text(error: CheckpointException) -> str:
    """Each failed rank's exception, without DCP's tracebacks (``rank 1: RuntimeError('Missing key ...')``)."""
    parts = []
    for rank, failure in sorted(getattr(error, "failures", {}).items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        parts.append(f"rank {rank}: {exc!r}")
    return "; ".join(parts) or repr(error)


def _upload(resp: Any) -> Any:
    return getattr(resp, "upload_completion", resp)
