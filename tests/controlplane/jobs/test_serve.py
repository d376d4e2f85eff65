"""``manage.py serve`` keeps web, worker and beat alive: a real serve (embedded defaults in a fresh data
dir), its worker killed with SIGKILL, comes back while the web keeps answering; SIGTERM stops all."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from controlplane import supervisor
from controlplane.healthz import read_supervised

ROOT = Path(__file__).resolve().parents[3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except OSError as e:
        return getattr(e, "code", 0) or 0, str(e)


def _wait(cond, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_it_restarts_a_killed_worker_while_the_web_keeps_answering(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update(UNBROKEN_DATA_DIR=str(tmp_path), PYTHONPATH=f"{ROOT}:{ROOT / 'trainer'}")
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT, env=env,
                   check=True)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    serve = subprocess.Popen([sys.executable, "manage.py", "serve", "--port", str(port),
                              "--web-workers", "1"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        def three_children():
            status, body = _get(f"{base}/healthz")
            children = read_supervised(body) if status == 200 else {}
            return len(children) == 3 and children

        first = _wait(three_children, 60, "the web and three children")
        worker_pid = int(first["worker"]["pid"])
        os.kill(worker_pid, signal.SIGKILL)
        # The web keeps answering while the worker is down and restarted.
        seen = []

        def back():
            status, body = _get(f"{base}/healthz")
            seen.append(status)
            c = read_supervised(body) if status == 200 else {}
            w = c.get("worker", {})
            return w.get("alive") == "1" and w.get("pid") not in (None, str(worker_pid)) and c

        after = _wait(back, 30, "the worker restarted")
        assert after["worker"]["restarts"] == "1"
        assert after["web"]["restarts"] == "0" and after["beat"]["restarts"] == "0"
        assert set(seen) == {200}
        assert _alive(int(after["worker"]["pid"])) and not _alive(worker_pid)
        status, text = _get(f"{base}/metrics")
        assert status == 200
        assert 'unbroken_process_restarts_total{process="worker"} 1.0' in text
        assert 'unbroken_process_up{process="worker"} 1.0' in text
        pids = [int(c["pid"]) for c in after.values()]
        serve.send_signal(signal.SIGTERM)
        out, _ = serve.communicate(timeout=30)
        assert serve.returncode == 0, out
        assert "worker (pid" in out and "exited with signal 9" in out
        assert "restarting worker (restart 1)" in out
        assert not any(_alive(p) for p in pids)
        assert not (tmp_path / supervisor.STATE_FILE).exists()
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.communicate()


def test_it_backs_off_doubling_up_to_a_cap():
    assert [supervisor.backoff_s(n) for n in (1, 2, 3, 4, 5, 6, 7)] == [1, 2, 4, 8, 16, 30, 30]


def test_it_ignores_a_state_file_whose_supervisor_is_gone(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / supervisor.STATE_FILE).write_text(f'{{"pid": {dead.pid}, "children": {{}}}}')
    assert supervisor.read_state(tmp_path) is None
