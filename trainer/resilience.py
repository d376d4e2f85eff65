"""The resilience layers that wrap the training loop; each does nothing when it is off.

- In-process (NVRx ``inprocess.Wrapper``): a fault restarts the loop function inside the same processes.
  On CPU three things make it work (see the research memo): (1) abort shuts down this process's gloo
  TCP sockets before destroying the process groups - ``ProcessGroupGloo.abort()`` does not unblock a
  rank waiting in a collective; (2) ``progress_watchdog_interval`` > ``monitor_process_interval``, or
  the monitor process never evaluates the soft/hard timeouts; (3) the Wrapper store lives outside the
  ranks (``trainer.launch``), so losing rank 0 does not take it down. No CUDA health checks on CPU.
- In-job (NVRx ``ft_launcher``): ranks send heartbeats (``trainer.liveness``); the launcher's rank monitors
  kill a silent group and restart it.

NB: no ``from __future__ import annotations`` here: NVRx finds the CallWrapper parameter by its
annotation object.
"""

import datetime
import logging
import os
import socket
import threading
from typing import Any, Callable, Optional

import psutil
import torch
import torch.distributed as dist

from trainer import nvrx_compat
from trainer.liveness import NoRestart
from trainer.runtime import Session, take_fault
from trainer.stacks import exception_text, in_collective, main_thread_stack
from trainer.wire import MAX_EVIDENCE_CHARS, CycleMark, EventKind, FaultClass, Layer

log = logging.getLogger(__name__)


def td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


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


class _Round:
    """This in-job round's keys in the stores trainer.launch hosts for all rounds: the Wrapper's barriers
    count arrivals, so every round needs its own key space (``prefix``)."""

    def __init__(self, session: Session, inprocess: Any):
        self.session, self.inprocess = session, inprocess
        self.prefix = f"a{session.cfg.attempt}/ij{session.env.restart_count}/"

    def store_factory(self) -> Any:
        prefix = self.prefix

        class RoundStore(torch.distributed.PrefixStore, self.inprocess.store.StoreMixin):
            """The Wrapper store of this in-job round."""

            def __init__(self, host_name: str, port: int, timeout: datetime.timedelta):
                base = torch.distributed.TCPStore(host_name, port, is_master=False, use_libuv=True,
                                                  timeout=timeout)
                super().__init__(prefix, base)

        return RoundStore if self.session.env.stores_external else self.inprocess.store.TCPStore

    def records_of(self, iteration: int) -> list[dict[str, Any]]:
        env = self.session.env
        try:
            store = dist.TCPStore(env.store_host, env.wrapper_store_port, is_master=False, use_libuv=True,
                                  timeout=td(5))
            if env.stores_external:
                store = torch.distributed.PrefixStore(self.prefix, store)
            ps = self.inprocess.store.PrefixStore(iteration, store)
            return [{"rank": r.rank, "interruption": r.interruption.name} for r in ps.get_interruption_records()]
        except Exception as e:  # noqa: BLE001 - the records only annotate the restart; logged
            log.warning("interruption records of iteration %s unavailable: %r", iteration, e)
            return []

    def stack_key(self, iteration: int, rank: int) -> str:
        return f"unbroken/stack/{self.prefix}it{iteration}/r{rank}"

    def keep_stack(self, iteration: int, rank: int, stack: str) -> None:
        """Each rank's main-thread stack at abort: rank 0 tells a hung rank from those waiting for it."""
        app_store = self.session.app_store
        try:
            if app_store is not None:
                app_store.set(self.stack_key(iteration, rank), stack)
        except Exception:  # evidence is best effort
            log.warning("could not keep the stack at abort", exc_info=True)

    def hung_rank(self, iteration: int, world_size: int) -> tuple[int, str] | None:
        """The first rank whose loop stopped outside a collective (its peers wait in one), and its stack."""
        app_store = self.session.app_store
        for r in range(world_size):
            try:
                key = self.stack_key(iteration, r)
                if app_store is None or not app_store.check([key]):
                    continue
                stack = app_store.get(key).decode("utf-8", "replace")
            except Exception:  # noqa: BLE001 - a rank whose stack cannot be read is skipped
                continue
            if stack and not in_collective(stack):
                return r, stack
        return None


def _abort(round_: _Round) -> Any:
    session, inprocess = round_.session, round_.inprocess
    env = session.env
    keep_ports = (env.app_store_port, env.wrapper_store_port, int(os.environ.get("MASTER_PORT", "0")))
    gloo = session.device.type == "cpu"

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
            except Exception as e:  # noqa: BLE001 - logged below ("abort failed"); the cycle goes on
                failed = e
            session.mark(cycle, CycleMark.ABORTED)
            if stack:
                log.info("abort at step %s: %s", session.last_step, stack)
                round_.keep_stack(state.iteration, state.rank, stack)
            if closed is not None:
                log.info("abort: shut down %d gloo sockets", closed)
            if failed is not None:
                log.error("abort failed", exc_info=failed)
            return state

    return Abort()


def _finalize(session: Session, inprocess: Any) -> Any:
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
                settle_checkpoint(session.checkpointer, budget_s=min(5.0, session.cfg.hard_timeout / 4))
                session.checkpointer = None
            session.ft.stop()
            return state

    return Finalize()


def _report_recovered_fault(round_: _Round, state: Any, cycle: Any) -> None:
    """Rank 0, after a restart: the fault it recovers from, from the facts a rank left (``take_fault``),
    else the Wrapper's interruption records, with the hung rank's stack for a hang."""
    session = round_.session
    recs = round_.records_of(state.iteration - 1)
    facts = take_fault(session.app_store, session.env.restart_count) or {}
    if facts.get("kind") == "command":  # an operator asked for this restart; it is not a fault
        session.mark(cycle, CycleMark.FAULT, at=float(facts["at"]), step=facts.get("step"),
                     command_id=facts.get("command_id"))
        return
    names = [r["interruption"] for r in recs]
    fault = facts.get("fault") or _interruption_to_fault(names)
    ranks = sorted({r["rank"] for r in recs})
    rank = facts.get("rank", ranks[0] if ranks else None)
    message = _with_traceback(facts.get("message") or ", ".join(
        f"rank {r['rank']}: {r['interruption']}" for r in recs), facts.get("traceback"))
    world = getattr(state, "world_size", None) or int(os.environ.get("WORLD_SIZE", "1"))
    hung = round_.hung_rank(state.iteration - 1, world) if fault == FaultClass.HANG \
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


def _initialize(round_: _Round) -> Any:
    session = round_.session

    class Initialize(round_.inprocess.initialize.Initialize):
        """Main thread, every iteration: the restart is done; rank 0 reports the fault it recovers from."""

        def __call__(self, state: Any) -> Any:
            session.iteration = state.iteration
            if state.iteration == 0:
                return state
            cycle = session.cycle(state.iteration)
            session.mark(cycle, CycleMark.RESTARTED)
            if state.rank == 0:
                _report_recovered_fault(round_, state, cycle)
            return state

    return Initialize()


def _terminate(inprocess: Any) -> Any:
    class Terminate(inprocess.terminate.Terminate):
        def __call__(self, state: Any) -> Any:
            log.error("in-process restart gave up on rank %s (iteration %s): %r", state.rank, state.iteration,
                      state.fn_exception)
            return state

    return Terminate()


def build_in_process_wrapper(session: Session) -> Any:
    """NVRx's in-process Wrapper with our hooks (abort, finalize, initialize, terminate) and timings."""
    from nvidia_resiliency_ext import inprocess

    cfg, env = session.cfg, session.env
    round_ = _Round(session, inprocess)
    log_dir = os.path.join(cfg.run_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    hb_timeout = cfg.hard_timeout + 5.0
    barrier = max(120.0, hb_timeout + 30.0, cfg.ckpt_timeout)
    kwargs = nvrx_compat.wrapper_kwargs(
        store_factory=round_.store_factory(),
        store_kwargs={"host_name": env.store_host, "port": env.wrapper_store_port, "timeout": td(barrier)},
        # Compose runs right to left: the retry limits first, then our reporting.
        initialize=inprocess.Compose(
            _initialize(round_),
            # The full world or nothing: a lost rank is the in-job layer's (or the job's) to restart,
            # and a fixed world keeps the data, and so the loss curve, identical to an uninterrupted run.
            inprocess.initialize.RetryController(max_iterations=cfg.max_in_process_restarts + 1,
                                                 min_world_size=env.world_size),
        ),
        abort=_abort(round_),
        finalize=_finalize(session, inprocess),
        health_check=None,  # CudaHealthCheck is a no-op on CPU; a rank is healthy if it got here
        terminate=_terminate(inprocess),
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

