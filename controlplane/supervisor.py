"""Keep the control plane's processes alive: ``manage.py serve`` (what ``make up`` runs).

A small restart loop rather than a supervisor library: supervisord and circus are daemons with their
own configuration and control socket (circus also needs ZeroMQ), and honcho stops every process when
one exits, which is the behaviour this replaces. The embedded default stays one foreground command
with no server of its own; production runs each process under its platform's supervisor instead
(Kubernetes restart policies in ``deploy/k8s``, systemd units in ``deploy/systemd``).

1. Every child runs in its own process group, so a signal reaches the processes it forked (uvicorn's
   workers, Celery's pool).
2. A child that exits while the supervisor is running is logged and started again after a backoff
   that doubles from ``BACKOFF_MIN_S`` to ``BACKOFF_MAX_S`` with each exit in a row; a child that stayed
   up ``STABLE_S`` resets it. The other children keep running meanwhile.
3. Only SIGINT or SIGTERM stops everything: SIGTERM to every group, SIGKILL after ``GRACE_S``.
4. The supervisor's state (children, pids, restart counts, last exit) is written atomically to
   ``<data dir>/serve-state.json`` on every change, for ``/healthz`` and ``/metrics`` in the web
   children, and removed on exit. ``read_state`` ignores a file whose supervisor is gone.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("unbroken.serve")

STATE_FILE = "serve-state.json"
BACKOFF_MIN_S = 1.0
BACKOFF_MAX_S = 30.0
STABLE_S = 60.0
GRACE_S = 10.0


@dataclass(slots=True)
class Child:
    name: str
    cmd: list[str]
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    exits_in_a_row: int = 0
    restart_at: float | None = None  # monotonic time of the next start while backing off
    last_exit: dict = field(default_factory=dict)

    def state(self) -> dict:
        alive = self.proc is not None and self.proc.poll() is None
        return {"pid": self.proc.pid if alive else None, "alive": alive, "restarts": self.restarts,
                "started_at": self.started_at, "last_exit": self.last_exit}


def backoff_s(exits_in_a_row: int) -> float:
    return min(BACKOFF_MAX_S, BACKOFF_MIN_S * 2 ** max(0, exits_in_a_row - 1))


class Supervisor:
    def __init__(self, cmds: dict[str, list[str]], *, state_dir: Path, env: dict[str, str] | None = None):
        self.children = {name: Child(name, cmd) for name, cmd in cmds.items()}
        self.state_path = Path(state_dir) / STATE_FILE
        self.env = env
        self.started_at = time.time()
        self.stopping = False

    def request_stop(self, *_: object) -> None:
        self.stopping = True

    def _start(self, c: Child) -> None:
        c.proc = subprocess.Popen(c.cmd, start_new_session=True, env=self.env)
        c.started_at = time.time()
        c.restart_at = None

    def _write_state(self) -> None:
        state = {"pid": os.getpid(), "started_at": self.started_at,
                 "children": {n: c.state() for n, c in self.children.items()}}
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.state_path)

    def poll_once(self, now: float | None = None) -> bool:
        """Restart what is due, notice what exited; True when anything changed."""
        now = time.monotonic() if now is None else now
        changed = False
        for c in self.children.values():
            if c.proc is None or (c.restart_at is not None and now >= c.restart_at):
                if c.proc is not None:
                    c.restarts += 1
                    log.warning("restarting %s (restart %d)", c.name, c.restarts)
                self._start(c)
                changed = True
                continue
            if c.restart_at is not None or c.proc.poll() is None:
                continue
            up_s = time.time() - c.started_at
            c.exits_in_a_row = 1 if up_s >= STABLE_S else c.exits_in_a_row + 1
            delay = backoff_s(c.exits_in_a_row)
            c.restart_at = now + delay
            code = c.proc.returncode
            _signal_group(c.proc, signal.SIGKILL)  # what the dead child forked (a pool, workers) goes too
            how = f"signal {-code}" if code < 0 else f"code {code}"
            c.last_exit = {"at": time.time(), "code": code, "up_s": round(up_s, 3)}
            log.error("%s (pid %d) exited with %s after %.1f s; restarting it in %.0f s",
                      c.name, c.proc.pid, how, up_s, delay)
            changed = True
        return changed

    def run(self, *, interval_s: float = 0.3) -> int:
        """Until ``request_stop``; then stop every child gracefully. Returns the exit code (0)."""
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            while not self.stopping:
                if self.poll_once():
                    self._write_state()
                time.sleep(interval_s)
        finally:
            self.stop_all()
        return 0

    def stop_all(self) -> None:
        procs = [c.proc for c in self.children.values() if c.proc is not None]
        for p in procs:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.1)
        for p in procs:
            _signal_group(p, signal.SIGKILL)
            p.wait()
        self.state_path.unlink(missing_ok=True)


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


def read_state(data_dir: Path) -> dict | None:
    """The running supervisor's state, or None (not under ``serve``, or the file is stale)."""
    try:
        state = json.loads((Path(data_dir) / STATE_FILE).read_text())
        os.kill(int(state["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return state
