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
"""

from __future__ import annotations

import collections
import contextlib
import copy
import io
import logging
import os
import pickle
import re
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
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


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer, writing each tensor without the zip CRC-32 that ``torch.save`` computes:
    ``torch.load`` never checks it (a corrupted tensor loads without error either way), and computing
    it reads every byte of the state once more per save: ~15 % of a save's CPU, and memory traffic that
    slows the steps an async save overlaps (make bench-checkpoint). torch's switch is per thread
    (context-local), so it is set only around the write, in the thread that writes."""

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


# -- the saver process -------------------------------------------------------------------------------
#
# DCP's THREAD executor plans, serializes and writes in a thread of the training process: it holds the
# GIL for much of that and its CPU time lands on the step's cores, so an async save costs the loop
# about what a sync one blocks (in slower steps). The saver process runs DCP's save instead (its
# PROCESS executor, one daemon per rank with its own gloo group), started once per process from the
# main thread and kept across in-process restarts, at the lowest CPU and I/O priority: it runs on
# what the steps leave idle. The staged copy lives in shared memory, so a save sends the saver
# handles, not bytes. It dies with its rank (PR_SET_PDEATHSIG); it never re-runs the user's script.

PR_SET_PDEATHSIG = 1
IOPRIO_CLASS_IDLE = 3
IOPRIO_WHO_PROCESS = 1
SAVER_NICE = 19

try:
    from torch.distributed.checkpoint._async_process_executor import (
        _AsyncCheckpointProcess,
        _ProcessGroupInitInfo,
    )
except ImportError:  # an older torch: the THREAD executor only
    _AsyncCheckpointProcess = None  # type: ignore[assignment,misc]


def _follow_parent_at_low_priority(parent_pid: int) -> None:
    """In the saver process, before its gloo group's threads start (they inherit all of this)."""
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the rank died before the line above
        os._exit(0)
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, SAVER_NICE)
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    with contextlib.suppress(Exception):  # ioprio_set (x86_64: 251, aarch64: 30)
        nr = {"x86_64": 251, "aarch64": 30}.get(os.uname().machine)
        if nr is not None:
            libc.syscall(nr, IOPRIO_WHO_PROCESS, 0, IOPRIO_CLASS_IDLE << 13)


def _tensor_key(t: torch.Tensor) -> tuple | None:
    """A staged tensor by its shared-memory segment (a name never reused) and view, or None."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type != "cpu":
        return None
    st = t.untyped_storage()
    if not st.is_shared():
        return None
    return (st._share_filename_cpu_()[1], t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


class _RequestPickler(ForkingPickler):
    """A save request with every staged tensor the saver already holds sent as its key: the stager reuses
    its buffers, so from the second save on only the small non-tensor values travel."""

    def __init__(self, file: Any, known: set) -> None:
        super().__init__(file, 4)
        self.known, self.used = known, set()
        self._emitting: set[int] = set()

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor) or id(obj) in self._emitting:
            return None
        key = _tensor_key(obj)
        if key is None:
            return None
        self.used.add(key)
        if key in self.known:
            return ("known", key)
        self._emitting.add(id(obj))
        return ("new", key, obj)


class _RequestUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, cache: dict) -> None:
        super().__init__(file)
        self.cache, self.used = cache, {}

    def persistent_load(self, pid: Any) -> Any:
        t = pid[2] if pid[0] == "new" else self.cache[pid[1]]
        self.used[pid[1]] = t
        return t


if _AsyncCheckpointProcess is not None:

    class SaverProcess(_AsyncCheckpointProcess):  # type: ignore[misc,valid-type]
        """DCP's checkpoint daemon, at low priority, tied to its rank, holding the staged tensors it was
        sent (their shared memory stays mapped) so that a save sends only what changed."""

        def __init__(self, pg_init_info: Any) -> None:
            self._known: set = set()
            super().__init__(pg_init_info)

        def _send(self, data: Any) -> None:
            # Storages by shared-memory name: the default (file descriptors) has the saver fetch every
            # storage's descriptor from this process's resource-sharer thread, hundreds of GIL-bound
            # round trips that stall the training thread.
            import torch.multiprocessing as tmp

            buf = io.BytesIO()
            before = tmp.get_sharing_strategy()
            tmp.set_sharing_strategy("file_system")
            try:
                p = _RequestPickler(buf, self._known)
                p.dump(data)
            finally:
                tmp.set_sharing_strategy(before)
            self._process_pipe.send_bytes(buf.getbuffer())
            self._known = p.used  # what the saver holds once it has read this request

        @staticmethod
        def _checkpointing_subprocess(pg_init_info: Any, parent_conn: Any) -> None:
            """torch's serving loop, reading requests with the saver's tensor cache."""
            from torch.distributed.checkpoint._async_process_executor import _CheckpointSaveProcessControlOpts

            _follow_parent_at_low_priority(pg_init_info.parent_pid)
            try:
                os.environ.update(TORCHELASTIC_USE_AGENT_STORE="False",
                                  MASTER_ADDR=pg_init_info.tcp_store_master_addr,
                                  MASTER_PORT=str(pg_init_info.tcp_store_master_port),
                                  LOCAL_RANK=str(pg_init_info.local_rank), RANK=str(pg_init_info.global_rank),
                                  WORLD_SIZE=str(pg_init_info.world_size))
                dist.init_process_group(backend=dist.Backend.GLOO)
                dist.barrier()
                parent_conn.send(_CheckpointSaveProcessControlOpts.INIT_COMPLETE)
            except BaseException as e:
                parent_conn.send(e)
                return
            cache: dict = {}
            try:
                while True:
                    try:
                        data = parent_conn.recv_bytes()
                    except EOFError:
                        return
                    u = _RequestUnpickler(io.BytesIO(data), cache)
                    obj = u.load()
                    cache = u.used
                    if obj == _CheckpointSaveProcessControlOpts.TERMINATE:
                        return
                    try:
                        parent_conn.send(_AsyncCheckpointProcess._execute_save(
                            obj.staged_state_dict, checkpoint_request_id=obj.checkpoint_request_id,
                            storage_writer=obj.storage_writer, planner=obj.planner, no_dist=obj.no_dist,
                            use_collectives=obj.use_collectives))
                    except BaseException as e:
                        parent_conn.send(e)
                    del obj, u
            finally:
                dist.destroy_process_group()
                parent_conn.close()


@contextlib.contextmanager
def _without_main_module() -> Any:
    """multiprocessing's spawn re-imports ``__main__`` in the child (the user's script, run by the shim
    through runpy): hide it while the saver starts, so the child imports only what it unpickles."""
    import sys
    import types

    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def saver_process_available() -> bool:
    return _AsyncCheckpointProcess is not None


def _saver_alive() -> bool:
    import torch.distributed.checkpoint._async_process_executor as ape

    proc = ape._CHECKPOINT_PROCESS
    return proc is not None and proc._save_process.is_alive()


def _start_saver(pg: Any) -> None:
    """Every rank at once (one broadcast on ``pg``): this process's saver, if it has none."""
    import torch.distributed.checkpoint._async_process_executor as ape

    info = _ProcessGroupInitInfo(pg)
    info.parent_pid = os.getpid()  # type: ignore[attr-defined]
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("the checkpoint saver must be started from the main thread (PR_SET_PDEATHSIG "
                           "follows the thread that started it)")
    with _without_main_module():
        ape._CHECKPOINT_PROCESS = SaverProcess(info)


def stop_saver(timeout_s: float = 5.0) -> None:
    """End this process's saver (a save it may be stuck in dies with it)."""
    import torch.distributed.checkpoint._async_process_executor as ape

    proc, ape._CHECKPOINT_PROCESS = ape._CHECKPOINT_PROCESS, None
    if proc is None:
        return
    p = proc._save_process
    if p.is_alive():
        p.kill()
        p.join(timeout_s)
    with contextlib.suppress(Exception):
        proc._process_pipe.close()


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
        durable: int | None = None
        if self.rank == 0:
            durable = latest_durable(self.root)
            for step, path, ok in list_checkpoints(self.root):
                if not ok and (durable is None or step > durable):
                    self._emit(step=step, mode=None, state=CheckpointState.ABANDONED, detail="torn by a restart")
                    shutil.rmtree(path, ignore_errors=True)
        snap_step, snap = self.memory.get() if self.memory is not None else (None, None)
        views: list[Any] = [None] * dist.get_world_size(self.pg)
        saver_ok = self.saver and _saver_alive()
        local_step = self.local.newest() if self.local is not None else None
        dist.all_gather_object(views, (snap_step, durable, saver_ok, local_step), group=self.pg)
        if self.saver:  # every rank keeps its saver, or every rank starts a new one at the next save
            if all(v[2] for v in views):
                self._had_saver = True
            else:
                stop_saver()
        durable = views[0][1]
        steps = {v[0] for v in views}
        mem_step = steps.pop() if len(steps) == 1 else None
        if mem_step is not None and snap is not None and (durable is None or mem_step >= durable):
            target = {"app": state.state_dict()}
            state.load_state_dict(_copy_into(target, snap)["app"])
            self.restored_from = RestoredFrom.MEMORY
            return state.step
        if self.local is not None and self._load_local(state, {v[3] for v in views}, durable):
            return state.step
        if durable is None:
            return None
        dcp.load({"app": state}, checkpoint_id=step_dir(self.root, durable), process_group=self.pg)
        self.restored_from = RestoredFrom.DISK
        return state.step

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
        state.load_state_dict(_copy_into({"app": state.state_dict()}, copy_)["app"])
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
            if not _saver_alive():
                if self._had_saver:
                    raise RuntimeError("unbroken: this rank's checkpoint saver process died")
                _start_saver(self.pg)
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
        with self._atomic() if atomic else contextlib.nullcontext():
            with open(os.path.join(path, COMMITTED), "w") as f:
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


def _upload(resp: Any) -> Any:
    return getattr(resp, "upload_completion", resp)
