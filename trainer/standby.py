"""Standby ranks: rank processes started ahead of need, so an in-job restart's new ranks skip Python's
and torch's start-up (~2 s per rank on a CPU host: torch, FSDP2, DTensor, DCP, NVRx, the script's
installed packages).

``trainer.launch`` keeps a pool of ``nproc_per_node`` standby processes per node (``StandbyPool``). Each
is a fresh ``python -m trainer.standby --serve FD`` (exec'd, not forked: forked ranks carried the fork
server's copy-on-write memory and stepped ~8 % slower here) that imports what every rank imports
(``trainer.preload``) and then waits, idle, on a socket to the pool. ft_launcher still starts one
worker process per rank, as always; the worker is this module's client (``python -m trainer.standby
<shim args>``: the standard library only, ~50 ms), which hands its argv, environment, working directory
and standard streams to the pool; the pool gives them to a standby, which becomes the rank
(``trainer.shim``'s ``main``) and the client stays in place as the worker ft_launcher watches:

- signals sent to the worker (SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2) are forwarded to
  the rank;
- the rank's end is the worker's end: the same exit status, or death by the same signal (a SIGKILLed
  rank is a SIGKILLed worker, as ft_launcher, the restart policy and the job page expect);
- a worker killed outright (SIGKILL: ft_launcher's stop, a process-group kill) takes its rank with it:
  the pool sees the worker's socket close and kills the rank;
- the rank reports its own pid where NVRx's rank monitor needs one (it signals the rank itself).

The job's first ranks start in their own processes while the first standbys import beside them (at the
normal priority: done before training starts, so a clean run never shares its steps with an import).
Each standby taken is replaced by a new one ``REFILL_DELAY_S`` later, after the restarted ranks' own start
(process group, checkpoint load), so its imports do not compete with the recovery. Where the node allows
a process to lower its nice value again (CAP_SYS_NICE or RLIMIT_NICE, as for root on a host), a standby
imports at nice 19 (idle CPU first: the running steps barely notice it) and returns to nice 0 when it
becomes a rank; elsewhere it imports at the normal priority and costs the running steps the CPU a fresh
rank's start would have cost (about 1.5 s of one core per rank here). When no standby is left (two
restarts in a row faster than a refill) or the pool is gone, the client runs the rank in its own process
(exec of ``trainer.shim``): slower, never wrong. ``UNBROKEN_STANDBY_RANKS=0`` or ``--no-standby-ranks``
turns the pool off.

This module's top level imports the standard library only (the client must start fast).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from typing import Any

ENV_SOCKET = "UNBROKEN_STANDBY_SOCKET"
MAX_MSG = 1 << 20  # argv + environment of one rank
STANDBY_NICE = 19  # a refill's imports: idle CPU first (where the node lets it come back to 0)
REFILL_DELAY_S = 3.0  # after a standby is taken: past the new ranks' start (~0.5 s here)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)

log = logging.getLogger("trainer.standby")


def _send(sock: socket.socket, obj: Any, fds: list[int] | None = None) -> None:
    data = json.dumps(obj).encode()
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.sendall(data)


def _recv(sock: socket.socket, maxfds: int = 0) -> tuple[Any, list[int]]:
    """One message (SOCK_SEQPACKET keeps them whole) and its descriptors; (None, []) at EOF."""
    data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MSG, maxfds)
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(data), fds


# ---------------------------------------------------------------- the pool (in trainer.launch)


class StandbyPool:
    """``size`` standby ranks kept ready on this node, handed to workers that ask on ``address``."""

    def __init__(self, size: int, *, cwd: str | None = None, skip_first: int = 0) -> None:
        self.size = size
        # The job's first ``skip_first`` workers (its first ranks) start in their own processes while the
        # pool's first standbys import beside them at the normal priority: all imports are done before
        # training starts, and a clean run never has a standby importing during its steps.
        self._skip = skip_first
        self.cwd = cwd or os.getcwd()
        # A Linux abstract socket (no file to clean up), named without its leading NUL (it goes in the env).
        self.address = f"unbroken-standby-{os.getpid()}-{os.urandom(4).hex()}"
        self._idle: list[_Standby] = []
        self._lock = threading.Lock()
        self._stopped = False
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.taken = 0

    def start(self) -> StandbyPool:
        self._server.bind("\0" + self.address)
        self._server.listen(64)
        for _ in range(self.size):
            self._spawn(nice=0 if self._skip else STANDBY_NICE)
        threading.Thread(target=self._accept, name="standby-pool", daemon=True).start()
        return self

    def _spawn(self, nice: int = STANDBY_NICE) -> None:
        if self._stopped:
            return
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = subprocess.Popen([sys.executable, "-m", "trainer.standby", "--serve", str(child.fileno()), str(nice)],
                                    pass_fds=(child.fileno(),), cwd=self.cwd, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        except OSError as e:
            log.warning("cannot start a standby rank: %s", e)
            parent.close()
            return
        finally:
            child.close()
        with self._lock:
            if self._stopped:
                stale = True
            else:
                stale = False
                self._idle.append(_Standby(proc, parent))
        if stale:  # stopped while it started
            parent.close()
            proc.kill()
            proc.wait()

    def ready(self, n: int = 1) -> bool:
        """At least ``n`` standbys have finished their imports and wait."""
        with self._lock:
            return sum(s.is_ready() for s in self._idle) >= n

    def _take(self) -> tuple[subprocess.Popen, socket.socket] | None:
        """A ready standby, else the one that started first (still importing: it is ahead of a fresh start)."""
        with self._lock:
            for dead in [s for s in self._idle if not s.alive()]:  # died waiting (out of memory, a kill)
                dead.ctrl.close()
                self._idle.remove(dead)
            if not self._idle or self._stopped:
                return None
            pick = next((s for s in self._idle if s.is_ready()), self._idle[0])
            self._idle.remove(pick)
            self.taken += 1
            log.debug("rank given to standby %d (%s)", pick.proc.pid, "ready" if pick.ready else "still importing")
            return pick.proc, pick.ctrl

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # stopped
            threading.Thread(target=self._serve_worker, args=(conn,), name="standby-worker", daemon=True).start()

    def _serve_worker(self, conn: socket.socket) -> None:
        fds: list[int] = []
        try:
            request, fds = _recv(conn, maxfds=3)
            if request is None:
                return
            with self._lock:
                first, self._skip = self._skip > 0, max(0, self._skip - 1)
            if first:
                _send(conn, {"pid": None})  # one of the job's first ranks: it starts itself
                return
            got = self._take()
            if got is None:
                _send(conn, {"pid": None})  # none ready: the worker runs the rank itself
                return
            proc, ctrl = got
            refill = threading.Timer(REFILL_DELAY_S, self._spawn)
            refill.daemon = True
            refill.start()
            try:
                _send(ctrl, request, fds)
            except OSError:
                proc.kill()
                _send(conn, {"pid": None})
                return
            finally:
                ctrl.close()
            _send(conn, {"pid": proc.pid})
            watcher = threading.Thread(target=self._kill_when_gone, args=(conn, proc), daemon=True)
            watcher.start()
            code = proc.wait()
            try:
                _send(conn, {"exit": code})
                conn.shutdown(socket.SHUT_RDWR)  # ends the watcher's recv
            except OSError:
                pass
        except OSError as e:
            log.warning("standby pool: a worker's request failed: %s", e)
        finally:
            for fd in fds:
                os.close(fd)
            conn.close()

    @staticmethod
    def _kill_when_gone(conn: socket.socket, proc: subprocess.Popen) -> None:
        """The worker's end of ``conn`` closes only when the worker is gone: its rank goes with it."""
        try:
            while conn.recv(16):
                pass
        except OSError:
            pass
        if proc.poll() is None:
            proc.kill()

    def stop(self) -> None:
        """Stop handing out standbys and end the idle ones (ranks already handed out end with their workers)."""
        with self._lock:
            self._stopped = True
            idle, self._idle = self._idle, []
        try:
            self._server.close()
        except OSError:
            pass
        for s in idle:
            s.ctrl.close()  # a waiting standby exits on EOF; kill in case it is still importing
            s.proc.kill()
        for s in idle:
            try:
                s.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


class _Standby:
    def __init__(self, proc: subprocess.Popen, ctrl: socket.socket) -> None:
        self.proc, self.ctrl, self.ready = proc, ctrl, False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def is_ready(self) -> bool:
        """Whether it said so (its one message, read without waiting)."""
        if not self.ready:
            try:
                self.ready = bool(self.ctrl.recv(64, socket.MSG_DONTWAIT))
            except (BlockingIOError, OSError):
                pass
        return self.ready


# ---------------------------------------------------------------- a standby process


CAP_SYS_NICE = 23


def can_renice() -> bool:
    """Whether this process may lower its nice value back to 0 (CAP_SYS_NICE, or RLIMIT_NICE >= 20)."""
    import resource

    try:
        limit = resource.getrlimit(resource.RLIMIT_NICE)[0]
        if limit == resource.RLIM_INFINITY or limit >= 20:
            return True
        with open("/proc/self/status") as f:
            caps = next((line.split()[1] for line in f if line.startswith("CapEff:")), "0")
        return bool(int(caps, 16) >> CAP_SYS_NICE & 1)
    except (OSError, ValueError, AttributeError):
        return False


def serve(fd: int, nice: int = STANDBY_NICE) -> int:
    """A standby: import what ranks import (at ``nice`` where it can come back), wait for a worker's rank,
    become it."""
    from trainer.orphan import end_with_parent

    end_with_parent()  # the pool's launcher was SIGKILLed: no standby (nor the rank it became) outlives it
    ctrl = socket.socket(fileno=fd)
    niced = False
    if nice and can_renice():
        try:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
            niced = True
        except OSError:
            pass
    import trainer.preload  # imports UNBROKEN_PRELOAD_MODULES: the SDK's and the script's packages
    import trainer.shim

    try:
        ctrl.sendall(b"ready")
    except OSError:
        pass  # already handed a rank (the pool closed its end), or the pool is gone: read on
    request, fds = _recv(ctrl, maxfds=3)
    if request is None:
        return 0  # the pool stopped before it needed this one
    if niced:  # every thread: nice is per thread on Linux, and the imports may have started some
        for tid in os.listdir("/proc/self/task"):
            try:
                os.setpriority(os.PRIO_PROCESS, int(tid), 0)
            except ProcessLookupError:
                pass  # a thread that ended
    ctrl.close()
    for target, f in enumerate(fds):
        os.dup2(f, target)
        os.close(f)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["trainer.shim", *request["argv"]]
    trainer.shim.entry(*request["argv"])  # the rank, as the fork server runs one: exits with its status
    return 0


# ---------------------------------------------------------------- the worker (ft_launcher's process)


def client(argv: list[str]) -> int:
    """The worker: have a standby run this rank and mirror it; run it here when none is ready."""
    address = os.environ.get(ENV_SOCKET, "")
    pid = None
    if address:
        try:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            conn.connect("\0" + address)
            _send(conn, {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}, [0, 1, 2])
            answer, _ = _recv(conn)
            pid = answer and answer.get("pid")
        except OSError:
            pid = None
    if not pid:
        os.execv(sys.executable, [sys.executable, "-u", "-m", "trainer.shim", *argv])

    def forward(signum: int, _frame: Any) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for s in FORWARDED:
        signal.signal(s, forward)
    try:
        answer, _ = _recv(conn)  # a forwarded signal does not end the wait (PEP 475 retries it)
    except OSError:
        answer = None
    code = answer.get("exit") if answer else None
    if code is None:
        return 1  # the pool (the launcher) is gone
    if code < 0:  # the rank died by a signal: so does the worker
        for s in FORWARDED:
            signal.signal(s, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code
    return code


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        sys.exit(serve(int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else STANDBY_NICE))
    sys.exit(client(sys.argv[1:]))
