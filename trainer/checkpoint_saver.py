"""The checkpoint saver process: DCP's save of an async checkpoint, in a process of its own per rank at
the lowest CPU and I/O priority (``UNBROKEN_CKPT_SAVER=process``; ``trainer.checkpoint`` uses it)."""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import threading
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.distributed as dist

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
            except BaseException as e:  # noqa: BLE001 - sent to the parent, which raises it
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
                    except BaseException as e:  # noqa: BLE001 - sent to the parent, which raises it
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


def saver_alive() -> bool:
    import torch.distributed.checkpoint._async_process_executor as ape

    proc = ape._CHECKPOINT_PROCESS
    return proc is not None and proc._save_process.is_alive()


def start_saver(pg: Any) -> None:
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
