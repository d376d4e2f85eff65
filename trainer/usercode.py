"""The runtime behind a user's own training code: one per rank process, shared by the shim (Level 0)
and the public SDK (``unbroken``, Level 1).

What it gives a script that imports nothing of ours (Level 0): a ``rank_started`` event, an
``integration`` event (level, torch / NVRx versions), heartbeats from a background thread, progress
(step, loss) parsed from the script's own output lines, per-rank log files, fault facts for the
launcher (exception type, message and traceback; ``sys.exit(n)``; drills), the restart cycle's
``first_step`` mark, and a stack dump of every thread on ``SIGUSR1``.

What the SDK adds (Level 1): heartbeats from the loop itself (so a hung loop stops beating), phases,
commands at step boundaries, and ft_launcher heartbeats from the same calls.

Progress lines (Level 0) are ``trainer.progress_lines``'s.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

from trainer.config import TrainConfig
from trainer.control import EXIT_RESTART_IN_JOB, CommandInbox, Drills, ack_event
from trainer.progress_lines import LineTee, parse_progress
from trainer.reporter import Reporter, make_reporter
from trainer.runtime import RankEnv, connect_store, fault_key, hang_stack_path, record_fault_facts
from trainer.straggler import BusyClock
from trainer.wire import (
    CommandKind,
    CycleMark,
    DrillFault,
    EventKind,
    FaultClass,
    Layer,
    Phase,
    cycle_key,
    redact,
)

log = logging.getLogger(__name__)

SDK_VERSION = "0.1.0"
ENV_RESTART_COUNT = "UNBROKEN_RESTART_COUNT"
ENV_CHECKPOINT_DIR = "UNBROKEN_CHECKPOINT_DIR"

# Exceptions that mean "this code cannot start": retrying the same code cannot help.
_CANNOT_START = (ImportError, SyntaxError)
MAX_TRACEBACK_CHARS = 3000


def versions() -> dict[str, str]:
    from trainer import nvrx_compat

    try:
        import torch

        torch_v = torch.__version__.split("+")[0]
    except ImportError:
        torch_v = "not installed"
    return {"sdk": SDK_VERSION, "torch": torch_v, "nvrx": nvrx_compat.version_str(),
            "python": ".".join(map(str, sys.version_info[:3]))}


class UserRun:
    """One rank's link to the control plane while user code runs. Never raises into that code,
    except on purpose (a drill's exception)."""

    def __init__(self, *, cfg: TrainConfig, env: RankEnv, entrypoint: str, reporter: Reporter | None = None):
        self.cfg, self.env, self.entrypoint = cfg, env, entrypoint
        self.rank = env.initial_rank
        self.level = 0
        self.step_no = 0
        self.loss: float | None = None
        self.phase: str = Phase.INIT
        self.progress_seen = False
        self.stop_requested = False
        self._last_step_t: float | None = None
        self._moved_at = time.monotonic()  # when the step last grew (Level 0's hang watch)
        self._stacks_written = False
        self._first_step_marked = False
        self._closed = threading.Event()
        self._lock = threading.Lock()
        # Held while the level changes and while a command is taken at Level 0 or 1: the heartbeat thread
        # (Level 0) must not take one as the main thread moves to the SDK's full level, whose commands are
        # agreed across ranks (a rank that took it here would mark it done for a peer that no longer looks).
        self._level_lock = threading.Lock()
        self.inbox = CommandInbox(os.path.join(cfg.run_dir, f"commands_done_r{self.rank}.json"))
        self._acted: dict[int, float] = {}
        self.reporter = reporter or make_reporter(
            url=cfg.report_url, job_id=cfg.job_id, token=cfg.token, source=f"rank:{self.rank}", rank=self.rank,
            spool_dir=cfg.spool_dir, interval_s=cfg.report_interval, on_commands=self.inbox.offer,
            agent_url=cfg.agent_url)
        self.app_store = None
        if env.stores_external:
            try:
                self.app_store = connect_store(env, env.app_store_port, timeout_s=10.0)
            except Exception:  # facts for the launcher are best effort
                log.warning("app store unreachable; fault facts go to the control plane only", exc_info=True)
        self.drills = Drills(drills=cfg.drills, run_dir=cfg.run_dir, initial_rank=self.rank,
                             record_fault=lambda fault, message: self.record_fault(fault, message))
        self.ft: Any = None
        self.busy = BusyClock(cfg.straggler_window)  # Level 2's step clock (trainer.straggler)
        self._pending_fire: tuple[DrillFault, str] | None = None
        self._facts: dict[str, Any] | None = None  # the last fault this process recorded
        self._shared_at = 0.0
        self._beat_thread = threading.Thread(target=self._beat_loop, name="unbroken-heartbeat", daemon=True)

    # -- start and end ----------------------------------------------------------------------------------

    def start(self) -> None:
        os.environ[ENV_RESTART_COUNT] = str(self.env.restart_count)
        os.environ[ENV_CHECKPOINT_DIR] = self.cfg.ckpt_dir
        os.makedirs(self.cfg.ckpt_dir, exist_ok=True)
        with contextlib.suppress(Exception):  # a stack dump of every thread: kill -USR1 <pid>
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        with contextlib.suppress(ValueError):  # drills and commands seen off the main thread fire on it
            signal.signal(signal.SIGUSR2, self._on_fire_signal)
        self.reporter.heartbeat(step=0, phase=Phase.INIT)
        self.reporter.event(EventKind.RANK_STARTED, {
            "iteration": 0, "restart_count": self.env.restart_count, "world_size": self.env.world_size,
            "node": socket.gethostname(), "pid": os.getpid(), "initial_rank": self.rank,
            "settings": self.cfg.settings()})
        self._integration()
        cycle = self._cycle()
        if cycle is not None and cycle[1] == Layer.JOB:
            self._mark(CycleMark.RESTARTED)
        self._beat_thread.start()

    def finish(self) -> None:
        self._closed.set()
        if self.level == 0:  # share the last printed step (unpaced) unless a newer one is there; take it
            self._shared_progress()
            if self.progress_seen:
                self._shared_at = 0.0
                self._share(self.step_no, self.loss)
        self.reporter.heartbeat(step=self.step_no, phase=Phase.STOPPED, loss=self.loss)
        self.reporter.event(EventKind.RANK_FINISHED, {"step": self.step_no, "loss": self.loss})
        if self.ft is not None:
            self.ft.stop()
        self.reporter.close(timeout_s=10.0)

    def fail(self, exc: BaseException, *, cannot_start: bool = False) -> None:
        """Leave the facts of an exception that ends user code: the launcher reports the fault."""
        self._closed.set()
        if isinstance(exc, SystemExit):
            message = f"the script called sys.exit({exc.code!r})"
            tb = ""
        else:
            message = f"{type(exc).__name__}: {exc}"
            tb = "".join(traceback.format_exception(exc))[-MAX_TRACEBACK_CHARS:]
        fatal = cannot_start or (isinstance(exc, _CANNOT_START) and not self.progress_seen and self.level == 0)
        if fatal:
            message = f"the code failed before training started ({message}); fix it and start a new job"
        if self._facts is not None and not fatal:
            # A drill recorded this fault a moment ago (first record wins): add what the exception proves.
            rec = {**self._facts, "message": f"{self._facts['message']}: {message}"[:500], "traceback": tb}
            if self.app_store is not None:
                with contextlib.suppress(Exception):
                    self.app_store.set(fault_key(self.env.restart_count), json.dumps(rec))
        else:
            self.record_fault(FaultClass.EXCEPTION, message, traceback_text=tb, fatal=fatal)
        self.reporter.heartbeat(step=self.step_no, phase=Phase.STOPPED, loss=self.loss)
        if self.ft is not None:
            self.ft.stop()
        self.reporter.close(timeout_s=5.0)

    # -- facts ------------------------------------------------------------------------------------------

    def record_fault(self, fault: FaultClass | str, message: str, *, traceback_text: str = "",
                     fatal: bool = False, kind: str = "fault", command_id: int | None = None) -> None:
        # Evidence leaves the rank without secrets (the job's ingest token, anything that looks like one).
        message, traceback_text = redact(message, (self.cfg.token,)), redact(traceback_text, (self.cfg.token,))
        rec = {"fault": str(fault), "rank": RankEnv.rank(), "at": time.time(), "iteration": 0,
               "message": message[:500], "kind": kind, "traceback": traceback_text, "fatal": fatal,
               "step": self.step_no, **({"command_id": command_id} if command_id is not None else {})}
        self._facts = rec
        if self.app_store is not None:
            record_fault_facts(self.app_store, self.env.restart_count, rec)
        elif kind == "fault":  # no launcher to report it: say it ourselves
            self.reporter.event(EventKind.FAULT, {"fault": str(fault), "detected_by": "trainer",
                                                  "step": self.step_no,
                                                  "message": (message + "\n" + traceback_text)[:4000]})

    def _integration(self) -> None:
        self.reporter.event(EventKind.INTEGRATION, {"level": self.level, "entrypoint": self.entrypoint[:200],
                                                    **versions()})

    def _cycle(self) -> tuple[str, Layer] | None:
        a, rc = self.cfg.attempt, self.env.restart_count
        if rc > 0:
            return cycle_key(attempt=a, restart_count=rc), Layer.IN_JOB
        if a > 0:
            return cycle_key(attempt=a), Layer.JOB
        return None

    def _mark(self, mark: CycleMark, *, step: int | None = None) -> None:
        cycle = self._cycle()
        if cycle is None:
            return
        data: dict[str, Any] = {"cycle": cycle[0], "layer": cycle[1], "mark": mark}
        if step is not None:
            data["step"] = step
        self.reporter.event(EventKind.CYCLE, data)

    # -- progress -------------------------------------------------------------------------------------

    def progress(self, step: int, loss: float | None, *, tokens_per_s: float | None = None) -> None:
        """A step completed (from a progress line at Level 0, from ``Run.step`` at Level 1)."""
        now = time.perf_counter()
        with self._lock:
            step_time = None
            if self._last_step_t is not None and step > self.step_no:
                step_time = (now - self._last_step_t) / (step - self.step_no)
            self._last_step_t = now
            first = self._advance(step, loss)
        self.reporter.heartbeat(step=step, phase=Phase.TRAIN, loss=loss, step_time_s=step_time,
                                tokens_per_s=tokens_per_s)
        if first:
            self._mark(CycleMark.FIRST_STEP, step=step)
        self._share(step, loss)
        self._due_drills(step)
        if self.level > 0:
            self._commands(level=self.level)

    def _progress_key(self) -> str:
        return f"unbroken/progress/a{self.cfg.attempt}/ij{self.env.restart_count}"

    def _share(self, step: int, loss: float | None) -> None:
        """Level 0: scripts often print on rank 0 only; the other ranks take the step from the app store."""
        if self.level > 0 or self.app_store is None or time.monotonic() - self._shared_at < 0.5:
            return
        self._shared_at = time.monotonic()
        with contextlib.suppress(Exception):
            self.app_store.set(self._progress_key(), json.dumps([step, loss]))

    def _shared_progress(self) -> None:
        """Take a newer step from the store (a rank's own lines may stop early: "resumed from step N")."""
        if self.app_store is None:
            return
        try:
            if not self.app_store.check([self._progress_key()]):
                return
            step, loss = json.loads(self.app_store.get(self._progress_key()))
        except Exception:  # noqa: BLE001 - progress is best effort: the step stays as it was
            return
        if step > self.step_no:  # training moves, though this rank prints nothing
            if self._advance(step, loss):
                self._mark(CycleMark.FIRST_STEP, step=step)
            self._due_drills(step)

    def _advance(self, step: int, loss: float | None) -> bool:
        """Training is at ``step``, from either source of progress (this rank's own, or the step another
        rank shared): the step, its loss and the phase; the hang watch's clock restarts when the step grew.
        True the first time, when the caller marks the cycle's first step (after its own report of it)."""
        if step > self.step_no:
            self._moved_at, self._stacks_written = time.monotonic(), False
        self.step_no, self.loss, self.phase = step, loss, Phase.TRAIN
        self.progress_seen = True
        first, self._first_step_marked = not self._first_step_marked, True
        return first

    def on_line(self, line: str) -> None:
        if self.level > 0:
            return
        parsed = parse_progress(line)
        if parsed is not None:
            self.progress(*parsed)

    def _due_drills(self, step: int) -> None:
        for d in self.drills.due(step, rank=RankEnv.rank()):
            if d.fault == DrillFault.SLOW_RANK:  # needs the SDK's step clock (Level 2); spec validation says so
                log.warning("drill %s: slow_rank needs the SDK's entrypoint function (Level 2); skipped", d.key)
                continue
            self._fire(d.fault, f"drill {d.key}")

    def _fire(self, fault: DrillFault, message: str) -> None:
        """Inject ``fault`` into the user's code: on the main thread, where that code runs."""
        if threading.current_thread() is threading.main_thread() or fault == DrillFault.SIGKILL:
            self.drills.fire(fault, rank=RankEnv.rank(), hang_pg=None, world_size=self.env.world_size,
                             message=message)
            return
        self._pending_fire = (fault, message)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR2)

    def _on_fire_signal(self, _signum: int, _frame: Any) -> None:
        pending, self._pending_fire = self._pending_fire, None
        if pending is not None:
            self.drills.fire(pending[0], rank=RankEnv.rank(), hang_pg=None, world_size=self.env.world_size,
                             message=pending[1])

    def _commands(self, *, level: int) -> None:
        """Act on commands at a step boundary of Level ``level`` (0: the heartbeat thread; 1: the loop's
        report): every rank receives them; rank 0 (or the target) acks. Nothing acts before the first step
        (the code may still be importing), nor once the level is another (an ``unbroken.entrypoint``
        function's commands are agreed across ranks by the SDK's loop)."""
        with self._level_lock:
            if self.level != level or level >= 2 or (level == 0 and not self.progress_seen):
                return
            self._take_command()

    def _take_command(self) -> None:
        cmd = self.inbox.peek()
        if cmd is None:
            return
        cid, kind, target = int(cmd["id"]), cmd.get("kind"), cmd.get("rank")
        acks = self.rank == (0 if target is None else target)
        if kind == CommandKind.STOP and self.level == 0:
            self.inbox.done(cid)  # a script without the SDK cannot stop itself: the launcher stops it
            return
        if kind == CommandKind.STOP:
            self.stop_requested = True
            # Every rank must see the stop before the ack ends its delivery: wait two report intervals.
            first = self._acted.setdefault(cid, time.monotonic())
            if time.monotonic() - first < 2 * self.cfg.report_interval:
                return
            self.inbox.done(cid)
            if acks:
                self.reporter.event(*ack_event(cid, True, "stop_requested() is now true"))
            return
        self.inbox.done(cid)
        if kind == CommandKind.RESTART and cmd.get("level") == Layer.IN_JOB and self.env.in_job:
            if acks:
                self.reporter.event(*ack_event(cid, True, "accepted"))
            self.record_fault("command", f"restart command {cid}", kind="command", command_id=cid)
            self.reporter.heartbeat(step=self.step_no, phase=Phase.RESTARTING)
            self.reporter.close(timeout_s=5.0)
            os._exit(EXIT_RESTART_IN_JOB)  # ft_launcher restarts the group
        if kind == CommandKind.INJECT_FAULT and target in (None, self.rank):
            try:
                fault = DrillFault(cmd.get("fault"))
            except ValueError:
                fault = None
            if fault in (DrillFault.EXCEPTION, DrillFault.HANG, DrillFault.SIGKILL):
                if acks:
                    self.reporter.event(*ack_event(cid, True, "accepted"))
                    self.reporter.flush()
                self._fire(fault, f"command {cid}")
                return
        if acks:
            self.reporter.event(*ack_event(cid, False, f"{kind} {cmd.get('level') or cmd.get('fault') or ''} needs "
                                           "the SDK's full level (an entrypoint function) or in-job restarts"))

    # -- heartbeats ----------------------------------------------------------------------------------

    def _beat_loop(self) -> None:
        """Level 0: the rank is alive as long as its process is. Level 1 beats from the loop instead."""
        while not self._closed.wait(self.cfg.report_interval):
            if self.level >= 1:  # the loop beats from now on: this thread has nothing left to do
                return
            try:
                self._shared_progress()
                self.reporter.heartbeat(step=self.step_no, phase=self.phase, loss=self.loss)
                self._commands(level=0)
                self._watch_progress()
            except Exception:  # never let this thread die; the facts are best effort
                log.warning("heartbeat thread", exc_info=True)

    def _watch_progress(self) -> None:
        """Level 0: this thread beats while the process lives, so a hung loop is seen only in its step, the
        one a script prints (shared by the ranks that print none). Once training has shown progress, a step
        that does not move for the spec's ``stall_timeout_s`` ends the rank as hung: its threads' stacks
        first (the launcher reports them; the control plane tells the hung rank from the peers that wait
        for it in a collective), then an exit that ft_launcher restarts in-job (or the launcher, the job).
        A pause longer than that between progress lines (a long save, an evaluation) needs a longer
        ``stall_timeout_s``, or Level 1's phases."""
        limit = self.cfg.stall_timeout
        if self.level > 0 or not self.progress_seen or not limit or self._closed.is_set():
            return
        idle = time.monotonic() - self._moved_at
        if idle >= limit - min(2.0, limit / 4) and not self._stacks_written and self.cfg.run_dir:
            # A little before the end, so that every stuck rank's stacks are there when the first one exits.
            self._stacks_written = True
            with contextlib.suppress(OSError), open(hang_stack_path(self.cfg.run_dir, self.rank), "w",
                                                    encoding="utf-8") as f:
                faulthandler.dump_traceback(file=f, all_threads=True)
        if idle < limit:
            return
        self.record_fault(FaultClass.HANG, f"rank {self.rank}'s step has not moved from {self.step_no} for "
                          f"{idle:.0f} s (stall_timeout_s={limit:g}; without the SDK the step the script prints "
                          "is the only sign of progress): ended as hung")
        self._closed.set()
        self.reporter.heartbeat(step=self.step_no, phase=Phase.RESTARTING, loss=self.loss)
        self.reporter.close(timeout_s=5.0)
        os._exit(EXIT_RESTART_IN_JOB)  # ft_launcher restarts the group; without it, the launcher the job

    # -- Level 1 ----------------------------------------------------------------------------------------

    def upgrade(self, level: int = 1) -> None:
        """``unbroken.init()`` (1) or an ``unbroken.entrypoint`` function (2) was called: the loop reports
        from now on."""
        if self.level >= level:
            return
        with self._level_lock:
            had_ft, self.level = self.level >= 1, level
        self._integration()
        if self.env.in_job and not had_ft:
            from trainer.liveness import FtClient, FtHeartbeats

            try:
                # A hung loop's stack, written before ft_launcher's heartbeat timeout kills the rank.
                path = hang_stack_path(self.cfg.run_dir, self.rank)
                stack = open(path, "w", encoding="utf-8")  # noqa: SIM115 - kept open for faulthandler
                # Each heartbeat is a round trip to the rank monitor process: ~1 s apart is plenty
                # against its timeout (the step timeout, tens of seconds by default).
                self.ft = FtHeartbeats(FtClient(), period_s=min(1.0, self.cfg.step_timeout / 10),
                                       stack_file=stack, dump_after_s=max(0.5, 0.75 * self.cfg.step_timeout))
                self.ft.start()
            except Exception:
                log.warning("ft_launcher heartbeats unavailable", exc_info=True)
                self.ft = None

    def ft_heartbeat(self) -> None:
        if self.ft is not None:
            self.ft.heartbeat()

    @contextlib.contextmanager
    def keep_alive(self) -> Iterator[None]:
        """ft_launcher keeps hearing from this rank, without steps, up to the checkpoint timeout."""
        if self.ft is None:
            yield
            return
        self.ft.keep_alive(time.monotonic() + self.cfg.ckpt_timeout)
        try:
            yield
        finally:
            self.ft.keep_alive(0.0)
            self.ft.heartbeat()

    @contextlib.contextmanager
    def in_phase(self, phase: Phase, *, slow: bool) -> Iterator[None]:
        """Report ``phase``; a slow one keeps ft_launcher fed, up to the checkpoint timeout."""
        prev = self.phase
        self.phase = phase
        self.reporter.heartbeat(step=self.step_no, phase=phase, loss=self.loss)
        try:
            with self.keep_alive() if slow else contextlib.nullcontext():
                yield
        finally:
            self.phase = prev if prev != Phase.INIT else Phase.TRAIN
            self.ft_heartbeat()
            self.reporter.heartbeat(step=self.step_no, phase=self.phase, loss=self.loss)


_current: UserRun | None = None


def current() -> UserRun | None:
    """The rank's ``UserRun`` when the product started this process (via the shim), else None."""
    return _current


def set_current(run: UserRun | None) -> None:
    global _current
    _current = run


def tee_output(run: UserRun, log_path: str) -> Any:
    """Route the rank's stdout (parsed) and stderr (kept) through its per-rank log file."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    log_file = open(log_path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - lives as long as the rank
    log_file.write(f"--- rank {run.rank}, attempt {run.cfg.attempt}, in-job round {run.env.restart_count}, "
                   f"pid {os.getpid()} ---\n")
    sys.stdout = LineTee(sys.stdout, log_file, run.on_line)
    sys.stderr = LineTee(sys.stderr, log_file, None)
    return log_file

