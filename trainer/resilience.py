"""The resilience layers that wrap the training loop; each does nothing when it is off.

- In-process (NVRx ``inprocess.Wrapper``): a fault restarts the loop function inside the same processes.
  On CPU three things make it work (see the research memo): (1) abort shuts down this process's gloo
  TCP sockets before destroying the process groups - ``ProcessGroupGloo.abort()`` does not unblock a
  rank waiting in a collective; (2) ``progress_watchdog_interval`` > ``monitor_process_interval``, or
  the monitor process never evaluates the soft/hard timeouts; (3) the Wrapper store lives outside the
  ranks (``trainer.launch``), so losing rank 0 does not take it down. No CUDA health checks on CPU.
- In-job (NVRx ``ft_launcher``): ranks send heartbeats; the launcher's rank monitors kill a silent
  group and restart it.

NB: no ``from __future__ import annotations`` here: NVRx finds the CallWrapper parameter by its
annotation object.
"""

import contextlib
import faulthandler
import datetime
import logging
import os
import socket
import threading
import time
from typing import Any, Callable, Optional

import psutil
import torch
import torch.distributed as dist

from trainer import nvrx_compat
from trainer.runtime import Session, take_fault
from trainer.evidence import exception_text, in_collective, main_thread_stack
from trainer.wire import MAX_EVIDENCE_CHARS, CycleMark, EventKind, FaultClass, Layer

log = logging.getLogger(__name__)


def td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class NoRestart:
    """The restart scope when in-process restart is off: iteration 0, no watchdog, no atomic lock."""

    iteration = 0

    def ping(self) -> None:
        pass

    def atomic(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


# -- in-job: ft_launcher rank monitor client -----------------------------------------------------------


class NullFt:
    def start(self) -> None:
        pass

    def heartbeat(self) -> None:
        pass

    def stop(self) -> None:
        pass


class FtClient:
    """Liveness for ft_launcher: heartbeats to this rank's monitor."""

    def __init__(self) -> None:
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

        self._client = RankMonitorClient()

    def start(self) -> None:
        # Reconnect on every in-process iteration: the rank may have been reassigned.
        self.stop()
        self._client.init_workload_monitoring()

    def heartbeat(self) -> None:
        self._client.send_heartbeat()

    def stop(self) -> None:
        if self._client.is_initialized:
            with contextlib.suppress(Exception):
                self._client.shutdown_workload_monitoring()


class _Pacer:
    """A thread that sends a progress signal every ``period_s`` when the loop made progress since the
    last one: the loop only counts (``tick``: O(1), no system call, no IPC on the step). A hung loop
    counts nothing, so the signals stop as they would if the loop sent them itself (detected at most
    ``period_s`` later). ``_lock`` serialises a send with whatever the subclass swaps under it."""

    thread_name = "unbroken-pacer"

    def __init__(self, period_s: float):
        self.period_s = period_s
        self.progress = 0
        self._sent = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def tick(self) -> None:
        self.progress += 1

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
            self._thread.start()

    def _due(self, progress: int) -> bool:
        return progress != self._sent

    def _send(self) -> None:  # under ``_lock``
        raise NotImplementedError

    def _after_send(self) -> None:  # outside the lock
        pass

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            with self._lock:
                progress = self.progress
                if not self._due(progress):
                    continue
                self._sent = progress
                with contextlib.suppress(Exception):
                    self._send()
            self._after_send()


class PacedFt(_Pacer):
    """ft_launcher heartbeats for the SDK (``heartbeat`` counts progress; the thread sends), also while
    ``keep_alive`` holds the rank alive through a slow phase without progress.

    ``stack_file``: a hang that only ft_launcher catches has no in-process layer to take the hung rank's
    stack, and ft_launcher kills it with SIGKILL. So each heartbeat sent re-arms ``faulthandler``'s
    watchdog (``dump_traceback_later``, C-level: it writes every thread's stack even while the main thread
    is stuck in a C call holding the GIL) to write the stacks to that file ``dump_after_s`` after the last
    heartbeat, before ft_launcher's timeout ends the rank; the launcher's hooks attach it to the fault."""

    thread_name = "unbroken-ft"

    def __init__(self, client: FtClient, period_s: float = 1.0, *, stack_file: Any = None,
                 dump_after_s: float = 0.0):
        super().__init__(period_s)
        self._client = client
        self._stack_file, self._dump_after_s = stack_file, dump_after_s
        self._armed_at = float("-inf")
        self._alive_until = 0.0

    def start(self) -> None:
        with self._lock:
            self._client.start()
        self._start()

    heartbeat = _Pacer.tick

    def keep_alive(self, until: float) -> None:
        """Keep sending until ``until`` (monotonic seconds) whether or not the loop progresses."""
        self._alive_until = until

    def stop(self) -> None:
        self._stop.set()
        if self._stack_file is not None:
            faulthandler.cancel_dump_traceback_later()
        with self._lock:
            self._client.stop()

    def _due(self, progress: int) -> bool:
        import time

        return progress != self._sent or time.monotonic() < self._alive_until

    def _send(self) -> None:
        self._client.heartbeat()

    def _after_send(self) -> None:
        # Re-armed at most every eighth of its delay (each arming joins faulthandler's watchdog thread and
        # starts a new one): the stacks are written between 7/8 of the delay and the delay after the last
        # heartbeat, still before ft_launcher's timeout.
        now = time.monotonic()
        due = now - self._armed_at >= self._dump_after_s / 8
        if self._stack_file is not None and not self._stop.is_set() and due:
            self._armed_at = now
            self._stack_file.seek(0)
            self._stack_file.truncate()  # the file holds the latest hang's stacks only
            faulthandler.dump_traceback_later(self._dump_after_s, file=self._stack_file)


class PacedPing(_Pacer):
    """NVRx in-process progress pings (``CallWrapper.ping``) for the armed attempt's scope. ``ping`` is
    a put on a multiprocessing queue to the monitor process (a lock, a wake-up of the queue's feeder
    thread); on the loop it cost the step up to a few ms at p99 on a node whose cores are all busy.
    Between attempts nothing is armed: no ping can land in a restart."""

    thread_name = "unbroken-ping"

    def __init__(self, period_s: float = 0.2):
        super().__init__(period_s)
        self._scope: Any = None

    def arm(self, scope: Any) -> None:
        with self._lock:
            self._scope, self._sent = scope, self.progress
        self._start()

    def disarm(self) -> None:
        with self._lock:
            self._scope = None

    def stop(self) -> None:
        self._stop.set()
        self.disarm()

    def _due(self, progress: int) -> bool:
        return self._scope is not None and progress != self._sent

    def _send(self) -> None:
        self._scope.ping()


class ProgressMark:
    """The loop's progress for the in-process layer, with no send of ours: each ``tick`` (once a step, on
    the loop) writes the time of that progress into the armed scope's progress-watchdog timestamp
    (``CallWrapper.progress_watchdog.timestamp.manual``, what ``CallWrapper.ping`` sets), which NVRx's
    own watchdog thread already sends to the monitor process every ``progress_watchdog_interval``.
    ``ping`` sends at once instead (a put on a multiprocessing queue, a wake of its feeder thread, the
    monitor process's read): from a thread of ours every 0.2 s that was ~10 wakes a second per rank,
    each taking the interpreter lock from the loop, for a timestamp the watchdog delivers anyway. The
    monitor now sees when the loop last progressed, not when a later ping went out, so a hang is
    detected ``soft_timeout`` after the last step (was up to one ping period later).

    ``tick`` is an attribute write and a monotonic clock read (vDSO: no system call). Between attempts
    nothing is armed (the Wrapper resets the watchdog's timestamp for the next one). A scope with no
    progress watchdog (an NVRx that moved it) gets pings from a ``PacedPing`` instead; in-process
    restart off (``NoRestart``): nothing."""

    def __init__(self, fallback_period_s: float = 0.2):
        self._watchdog: Any = None
        self._fallback_period_s = fallback_period_s
        self._fallback: Optional["PacedPing"] = None

    def arm(self, scope: Any) -> None:
        self.disarm()
        watchdog = getattr(scope, "progress_watchdog", None)
        if watchdog is not None and hasattr(watchdog, "timestamp"):
            self._watchdog = watchdog
        elif not isinstance(scope, NoRestart):
            if self._fallback is None:
                self._fallback = PacedPing(self._fallback_period_s)
            self._fallback.arm(scope)

    def tick(self) -> None:
        watchdog = self._watchdog
        if watchdog is not None:
            watchdog.timestamp.manual = time.monotonic()
        elif self._fallback is not None:
            self._fallback.tick()

    def disarm(self) -> None:
        self._watchdog = None
        if self._fallback is not None:
            self._fallback.disarm()

    def stop(self) -> None:
        self.disarm()
        if self._fallback is not None:
            self._fallback.stop()


# -- in-process: NVRx Wrapper and its hooks -------------------------------------------------------------


def settle_checkpoint(checkpointer: Any, *, budget_s: float) -> None:
    """Let an in-flight async save end (commit it if it completed, else report it abandoned) and
    close the stager, waiting at most ``budget_s`` + 1 s: the Wrapper's finalize must end well inside
    its hard timeout, or the restart escalates to ft_launcher. A save still stuck after that keeps
    settling in the background; its checkpoint stays uncommitted unless every shard was written."""

    def settle() -> None:
        checkpointer.abandon(timeout_s=budget_s)
        checkpointer.close()

    t = threading.Thread(target=settle, name="checkpoint-settle", daemon=True)
    t.start()
    t.join(budget_s + 1.0)
    if t.is_alive():
        log.warning("the in-flight checkpoint is still settling after %.1f s; restarting without it", budget_s + 1.0)


def shutdown_gloo_sockets(keep_ports: tuple[int, ...]) -> int:
    """shutdown(SHUT_RDWR) every established TCP socket of this process except the stores' ones.

    A thread blocked in a gloo collective then fails at once with "Connection closed by peer"; the
    store connections (and with them the Wrapper's own coordination) stay up.
    """
    keep = set(keep_ports)
    n = 0
    for c in psutil.Process().net_connections(kind="tcp"):
        if c.status != psutil.CONN_ESTABLISHED or not c.raddr or c.fd < 0:
            continue
        if c.laddr.port in keep or c.raddr.port in keep:
            continue
        try:
            s = socket.socket(fileno=os.dup(c.fd))
            s.shutdown(socket.SHUT_RDWR)
            s.close()
            n += 1
        except OSError:
            pass
    return n


def release_leaked_logging_locks() -> int:
    """Release the logging locks this thread holds outside any logging call; returns how many.

    NVRx interrupts the main thread with an asynchronous ``RankShouldRestart``. Landing as the thread
    enters ``Handler.release()`` (the ``finally`` of ``Handler.handle``; a rank whose collective fails
    because a peer aborted logs ``fn_ex`` just as its own monitor thread raises), it leaves the handler's
    RLock held by the main thread: the main thread still logs (the lock is reentrant), and the next
    restart's Abort, logging from the monitor thread, waits on it until the hard timeout kills the rank
    (an in-process fault recovered ~11 s later by ft_launcher). Call it on the main thread, from a hook
    no logging call is under (Finalize: the first hook after the raise): any lock held then is one such
    leak."""
    handlers: dict[int, logging.Handler] = {}
    for lg in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for h in getattr(lg, "handlers", ()):  # a PlaceHolder has none
            handlers[id(h)] = h
    locks = [logging._lock, *(h.lock for h in handlers.values())]  # type: ignore[attr-defined]
    n = 0
    for lock in locks:
        is_owned = getattr(lock, "_is_owned", None)  # an RLock (a plain Lock has no owner to check)
        while is_owned is not None and is_owned():
            lock.release()
            n += 1
    if n:
        log.warning("released %d logging lock(s) an interrupted log call left held by this thread", n)
    return n


def _with_traceback(message: str, tb: str | None) -> str:
    return f"{message}\n\n{tb}"[:MAX_EVIDENCE_CHARS] if tb else message


def _interruption_to_fault(names: list[str]) -> FaultClass:
    if any(n in ("SOFT_TIMEOUT", "HARD_TIMEOUT") for n in names):
        return FaultClass.HANG
    if any(n in ("TERMINATED", "UNRESPONSIVE") for n in names):
        return FaultClass.PROCESS_KILLED
    return FaultClass.EXCEPTION


def _is_peer_error(exc: BaseException) -> bool:
    """A rank failing because a peer or the abort closed its connections is not where the fault is."""
    text = repr(exc)
    return isinstance(exc, getattr(dist, "DistError", ())) or any(
        s in text for s in ("Connection closed", "Connection reset", "Broken pipe", "Socket", "gloo"))


def build_in_process_wrapper(session: Session) -> Any:
    from nvidia_resiliency_ext import inprocess

    cfg, env = session.cfg, session.env
    keep_ports = (env.app_store_port, env.wrapper_store_port, int(os.environ.get("MASTER_PORT", "0")))
    gloo = session.device.type == "cpu"

    round_prefix = f"a{cfg.attempt}/ij{env.restart_count}/"

    class RoundStore(torch.distributed.PrefixStore, inprocess.store.StoreMixin):
        """The Wrapper store of this in-job round. trainer.launch hosts one store for all rounds; the
        Wrapper's barriers count arrivals, so every round needs its own key space."""

        def __init__(self, host_name: str, port: int, timeout: datetime.timedelta):
            base = torch.distributed.TCPStore(host_name, port, is_master=False, use_libuv=True, timeout=timeout)
            super().__init__(round_prefix, base)

    store_factory = RoundStore if env.stores_external else inprocess.store.TCPStore

    def records_of(iteration: int) -> list[dict[str, Any]]:
        try:
            store = dist.TCPStore(env.store_host, env.wrapper_store_port, is_master=False, use_libuv=True,
                                  timeout=td(5))
            if env.stores_external:
                store = torch.distributed.PrefixStore(round_prefix, store)
            ps = inprocess.store.PrefixStore(iteration, store)
            return [{"rank": r.rank, "interruption": r.interruption.name} for r in ps.get_interruption_records()]
        except Exception as e:
            log.warning("interruption records of iteration %s unavailable: %r", iteration, e)
            return []

    def stack_key(iteration: int, rank: int) -> str:
        return f"unbroken/stack/{round_prefix}it{iteration}/r{rank}"

    def keep_stack(iteration: int, rank: int, stack: str) -> None:
        """Each rank's main-thread stack at abort: rank 0 tells a hung rank from those waiting for it."""
        try:
            if session.app_store is not None:
                session.app_store.set(stack_key(iteration, rank), stack)
        except Exception:  # evidence is best effort
            log.warning("could not keep the stack at abort", exc_info=True)

    def hung_rank(iteration: int, world_size: int) -> tuple[int, str] | None:
        """The first rank whose loop stopped outside a collective (its peers wait in one), and its stack."""
        for r in range(world_size):
            try:
                key = stack_key(iteration, r)
                if session.app_store is None or not session.app_store.check([key]):
                    continue
                stack = session.app_store.get(key).decode("utf-8", "replace")
            except Exception:
                continue
            if stack and not in_collective(stack):
                return r, stack
        return None

    class Abort(inprocess.abort.Abort):
        """MonitorThread, every rank: mark detection, unblock gloo, destroy the process groups."""

        def __call__(self, state: Any) -> Any:
            cycle = session.cycle(state.iteration + 1)
            session.mark(cycle, CycleMark.DETECTED)
            # Evidence for a hang: where this rank's main thread is now (taken from this monitor thread
            # before the abort moves it; the job log keeps it, and the fault page shows the rank's lines
            # around the fault). Logged after the abort: nothing a log call waits on delays the restart.
            stack = main_thread_stack((session.cfg.token,))
            closed, failed = None, None
            try:
                if gloo:
                    if dist.is_available() and dist.is_initialized():
                        closed = shutdown_gloo_sockets(keep_ports)
                        dist.destroy_process_group()
                else:
                    inprocess.abort.AbortTorchDistributed()(state)
            except Exception as e:
                failed = e
            session.mark(cycle, CycleMark.ABORTED)
            if stack:
                log.info("abort at step %s: %s", session.last_step, stack)
                keep_stack(state.iteration, state.rank, stack)
            if closed is not None:
                log.info("abort: shut down %d gloo sockets", closed)
            if failed is not None:
                log.error("abort failed", exc_info=failed)
            return state

    class Finalize(inprocess.finalize.Finalize):
        """Main thread, after abort: settle the in-flight checkpoint, keep the local fault's facts."""

        def __call__(self, state: Any) -> Any:
            release_leaked_logging_locks()
            exc = state.fn_exception
            if exc is not None and not _is_peer_error(exc):
                session.record_fault(FaultClass.EXCEPTION, repr(exc),
                                     traceback_text=getattr(exc, "_unbroken_traceback", None)
                                     or exception_text(exc, (session.cfg.token,)))
            if session.checkpointer is not None:
                settle_checkpoint(session.checkpointer, budget_s=min(5.0, cfg.hard_timeout / 4))
                session.checkpointer = None
            session.ft.stop()
            return state

    class Initialize(inprocess.initialize.Initialize):
        """Main thread, every iteration: the restart is done; rank 0 reports the fault it recovers from."""

        def __call__(self, state: Any) -> Any:
            session.iteration = state.iteration
            if state.iteration == 0:
                return state
            cycle = session.cycle(state.iteration)
            session.mark(cycle, CycleMark.RESTARTED)
            if state.rank != 0:
                return state
            recs = records_of(state.iteration - 1)
            facts = take_fault(session.app_store, env.restart_count) or {}
            if facts.get("kind") == "command":  # an operator asked for this restart; it is not a fault
                session.mark(cycle, CycleMark.FAULT, at=float(facts["at"]), step=facts.get("step"),
                             command_id=facts.get("command_id"))
                return state
            names = [r["interruption"] for r in recs]
            fault = facts.get("fault") or _interruption_to_fault(names)
            ranks = sorted({r["rank"] for r in recs})
            rank = facts.get("rank", ranks[0] if ranks else None)
            message = _with_traceback(facts.get("message") or ", ".join(
                f"rank {r['rank']}: {r['interruption']}" for r in recs), facts.get("traceback"))
            world = getattr(state, "world_size", None) or int(os.environ.get("WORLD_SIZE", "1"))
            hung = hung_rank(state.iteration - 1, world) if fault == FaultClass.HANG \
                and "rank" not in facts else None
            if hung is not None:  # the timeouts name whoever timed out first; the stacks name the hung rank
                rank = hung[0]
                message = f"rank {rank} hung outside a collective ({message})\n\n{hung[1]}"
                message = message[:MAX_EVIDENCE_CHARS]
            session.reporter.event(EventKind.FAULT, {
                "fault": fault, "cycle": cycle.key if cycle else None, "detected_by": Layer.IN_PROCESS,
                "message": message, "rank": rank,
                "interruption": ",".join(sorted(set(names))) or None, "interruptions": recs,
                "step": facts.get("step", session.last_step),
            }, rank=rank)
            if facts.get("at"):
                session.mark(cycle, CycleMark.FAULT, at=float(facts["at"]), step=facts.get("step"))
            return state

    class Terminate(inprocess.terminate.Terminate):
        def __call__(self, state: Any) -> Any:
            log.error("in-process restart gave up on rank %s (iteration %s): %r", state.rank, state.iteration,
                      state.fn_exception)
            return state

    log_dir = os.path.join(cfg.run_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    hb_timeout = cfg.hard_timeout + 5.0
    barrier = max(120.0, hb_timeout + 30.0, cfg.ckpt_timeout)
    kwargs = nvrx_compat.wrapper_kwargs(
        store_factory=store_factory,
        store_kwargs={"host_name": env.store_host, "port": env.wrapper_store_port, "timeout": td(barrier)},
        # Compose runs right to left: the retry limits first, then our reporting.
        initialize=inprocess.Compose(
            Initialize(),
            # The full world or nothing: a lost rank is the in-job layer's (or the job's) to restart,
            # and a fixed world keeps the data, and so the loss curve, identical to an uninterrupted run.
            inprocess.initialize.RetryController(max_iterations=cfg.max_in_process_restarts + 1,
                                                 min_world_size=env.world_size),
        ),
        abort=Abort(),
        finalize=Finalize(),
        health_check=None,  # CudaHealthCheck is a no-op on CPU; a rank is healthy if it got here
        terminate=Terminate(),
        # The monitor thread blocks in a store wait on the "a rank was interrupted" key, so it sees a
        # restart as soon as the key is set whatever this is; the interval is only that wait's timeout,
        # after which it raises (DistStoreError), loops and waits again. At 0.2 s that loop cost every
        # training step ~3-4 % on a 2-core node (median step time in 3 sets of 5 alternating runs:
        # 1.027-1.046 x a plain torchrun script; at 1.0 s: 0.98-1.00 x). Its one cost: a clean end of
        # the Wrapper waits up to this long for the thread to leave its wait.
        monitor_thread_interval=td(1.0),
        # The monitor process skips its timeout check on every progress-watchdog message: the watchdog
        # interval must be longer than the monitor interval or hangs are never detected.
        monitor_process_interval=td(0.5),
        progress_watchdog_interval=td(1.0),
        heartbeat_interval=td(1.0),
        heartbeat_timeout=td(hb_timeout),
        soft_timeout=td(cfg.soft_timeout),
        hard_timeout=td(cfg.hard_timeout),
        barrier_timeout=td(barrier),
        completion_timeout=td(barrier),
        # A pure sleep between the first interruption record and the abort (for concurrent faults of other
        # ranks to land in the records): every in-process recovery pays it.
        last_call_wait=td(0.05),
        termination_grace_time=td(2.0),
        # One file per in-job round: the next round's monitor would truncate the one that saw the fault.
        monitor_process_logfile=os.path.join(
            log_dir, f"inprocess_monitor_{{rank}}_a{cfg.attempt}_ij{env.restart_count}.log"),
    )
    return nvrx_compat.in_process_wrapper(cpu=session.device.type == "cpu", **kwargs)


def wrap_loop(session: Session, loop: Callable[[Any], Any]) -> Callable[[], Any]:
    """The loop as the configured layers run it: ``loop(scope)`` with scope.iteration/ping()/atomic()."""
    if not session.cfg.in_process:
        return lambda: loop(NoRestart())

    from nvidia_resiliency_ext import inprocess

    wrapper = build_in_process_wrapper(session)

    def iteration(call_wrapper: Optional[inprocess.CallWrapper] = None) -> Any:
        return loop(call_wrapper)

    return wrapper(iteration)

