"""The node agent: one per node, beside ft_launcher, that turns the node's ranks' reports into one request.

The ranks' reporters post to it on loopback exactly what they would post to the control plane (same
path, wire format and job token); it writes each batch to its disk spool before it answers, so a batch
it acknowledged survives its death, and answers at once with the job's pending commands as of its last
upstream answer. A sender thread sends the spooled batches upstream oldest first, as one batch per
interval for the whole node (up to the wire's per-batch limits), with event ids unchanged, so a replay
is stored once. Upstream 429/5xx/unreachable: it keeps them and retries (after Retry-After); a 4xx
for a merged batch: it sends that batch's parts one by one, so one rank's bad batch drops only itself.

Commands, the trade-off: ranks get the cached command set at once instead of waiting for the upstream
answer, so a rank's post never waits on the control plane. Between its posts a rank's reporter also
asks the agent for that set half-way through each interval (``GET .../commands``: loopback only, nothing
spooled, nothing sent upstream), so a command reaches the rank within one agent interval plus half a
rank interval of reaching the control plane. Ranks dedupe commands by id. A rank's ``command_ack`` skips
both waits on its way back: its reporter sends it at once and the agent sends a batch holding one
upstream at once, so click to acknowledgement is at most 1.5 heartbeat intervals plus the requests' own
time (inside the two intervals promised, with room for a slow request). The cost: one loopback GET per
rank per interval; the control plane sees no more requests.

Never a new single point of failure: a rank whose post to the agent fails (refused, timed out) sends
to the control plane directly (``HttpReporter``'s ``fallback_url``); ``trainer.launch`` restarts an agent
that exits. Standalone ranks (no launcher) never see one.

    UNBROKEN_TOKEN=... python -m trainer.agent --upstream http://cp:8000 --job-id 7 --port 0 --spool-dir DIR
"""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from trainer.reporter import DROP, OK, RETRY, Spool, post_batch
from trainer.wire import MAX_BODY_BYTES, MAX_EVENTS, MAX_HEARTBEATS, WIRE_VERSION, EventKind

log = logging.getLogger(__name__)

PATH = re.compile(r"^/api/v1/jobs/(\d{1,18})/ingest$")
COMMANDS_PATH = re.compile(r"^/api/v1/jobs/(\d{1,18})/commands$")


class NodeAgent:
    def __init__(self, *, upstream: str, job_id: str, token: str, spool_dir: str, interval_s: float = 1.0,
                 host: str = "127.0.0.1", port: int = 0, timeout_s: float = 10.0):
        self.endpoint = f"{upstream.rstrip('/')}/api/v1/jobs/{job_id}/ingest"
        self.job_id, self.interval_s, self.timeout_s = str(job_id), interval_s, timeout_s
        self._token = token
        self._auth = f"Bearer {token}".encode()
        self.spool = Spool(os.path.join(spool_dir, "agent"))
        self.source = f"agent:{socket.gethostname()}"[:128]
        self.commands: list[dict[str, Any]] = []
        self.job_status = ""
        self.upstream_requests = 0
        self.relayed_batches = 0
        self._hold_until = 0.0
        self._lock = threading.Lock()  # spool appends from handler threads
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.server = ThreadingHTTPServer((host, port), _handler(self))
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://{host}:{self.port}"

    # -- serving the ranks ---------------------------------------------------------------------------

    def take(self, job_id: str, auth: bytes, body: bytes) -> tuple[int, dict[str, Any]]:
        """A rank's batch: spooled, then answered (status, JSON)."""
        refused = self._refuse(job_id, auth)
        if refused is not None:
            return refused
        try:
            batch = json.loads(body)
        except ValueError:
            return 400, {"error": "the body is not JSON", "field": None}
        if (type(batch) is not dict or type(batch.get("heartbeats", [])) is not list
                or type(batch.get("events", [])) is not list):
            return 422, {"error": "a batch is an object with lists of heartbeats and events", "field": None}
        batch.pop("sent_at", None)
        with self._lock:
            self.spool.append(batch)
            self.relayed_batches += 1
        if any(type(e) is dict and e.get("kind") == EventKind.COMMAND_ACK for e in batch.get("events", ())):
            self._wake.set()  # an acknowledgement goes upstream now: the operator is waiting on it
        return 200, {"accepted": {"heartbeats": len(batch.get("heartbeats", [])),
                                  "events": len(batch.get("events", [])), "duplicates": 0},
                     "commands": self.commands, "server_time": time.time(), "job_status": self.job_status}

    def _refuse(self, job_id: str, auth: bytes) -> tuple[int, dict[str, Any]] | None:
        """The answer to a request for another job or with a wrong token; None when it may proceed."""
        if job_id != self.job_id:
            return 404, {"error": f"this node agent relays job {self.job_id}, not job {job_id}", "field": None}
        if not hmac.compare_digest(auth, self._auth):
            return 401, {"error": "missing or wrong job token", "field": None}
        return None

    def poll(self, job_id: str, auth: bytes) -> tuple[int, dict[str, Any]]:
        """A rank's look at the job's pending commands between its posts (nothing spooled or sent)."""
        refused = self._refuse(job_id, auth)
        if refused is not None:
            return refused
        return 200, {"commands": self.commands, "server_time": time.time(), "job_status": self.job_status}

    # -- sending upstream ----------------------------------------------------------------------------

    def send_pending(self) -> None:
        """Send what is spooled, one merged batch per request, oldest first, until it is sent or refused."""
        while not self._stop.is_set() and time.monotonic() >= self._hold_until:
            names, parts = self._next()
            if not names:
                return
            verdict = self._send({"v": WIRE_VERSION, "source": self.source,
                                  "heartbeats": [h for p in parts for h in p.get("heartbeats", [])],
                                  "events": [e for p in parts for e in p.get("events", [])]})
            if verdict == RETRY:
                return
            if verdict == DROP and len(parts) > 1:  # one part is bad: find it, keep the others
                for name, part in zip(names, parts, strict=True):
                    if self._send(part) == RETRY:
                        return
                    self.spool.remove(name)
                continue
            for name in names:
                self.spool.remove(name)

    def _next(self) -> tuple[list[str], list[dict[str, Any]]]:
        names, parts, hbs, evs = [], [], 0, 0
        for name in self.spool.pending():
            part = self.spool.load(name)
            if part is None:  # unreadable (a torn file): nothing to send
                self.spool.remove(name)
                continue
            h, e = len(part.get("heartbeats", [])), len(part.get("events", []))
            if parts and (hbs + h > MAX_HEARTBEATS or evs + e > MAX_EVENTS):
                break
            names.append(name)
            parts.append(part)
            hbs, evs = hbs + h, evs + e
        return names, parts

    def _send(self, batch: dict[str, Any]) -> str:
        body = json.dumps({**batch, "v": WIRE_VERSION, "sent_at": time.time()}, separators=(",", ":")).encode()
        verdict, raw, hold_s = post_batch(self.endpoint, self._token, body, self.timeout_s, who="node agent")
        if hold_s:
            self._hold_until = time.monotonic() + hold_s
        if verdict != OK:
            return verdict
        try:
            payload = json.loads(raw or b"{}")
        except ValueError:
            return RETRY
        self.upstream_requests += 1
        if isinstance(payload, dict):
            self.commands = payload.get("commands") or []
            self.job_status = str(payload.get("job_status") or "")
        return OK

    def _run_sender(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            try:
                self.send_pending()
            except Exception:  # the agent keeps relaying whatever one pass hit
                log.exception("node agent: unexpected error (continuing)")

    # -- life ----------------------------------------------------------------------------------------

    def start(self) -> NodeAgent:
        threading.Thread(target=self.server.serve_forever, name="agent-http", daemon=True).start()
        self._sender = threading.Thread(target=self._run_sender, name="agent-sender", daemon=True)
        self._sender.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop taking batches, then send what is spooled (within ``timeout_s``; the rest stays spooled)."""
        self.server.shutdown()
        self.server.server_close()
        self._stop.set()
        self._wake.set()
        self._sender.join(timeout_s)
        self._stop.clear()
        deadline = time.monotonic() + timeout_s
        while self.spool.pending() and time.monotonic() < deadline:
            self._hold_until = min(self._hold_until, deadline)
            before = len(self.spool.pending())
            self.send_pending()
            if len(self.spool.pending()) == before:
                time.sleep(0.2)


class AgentProcess:
    """``python -m trainer.agent`` for this node, kept running: started again (same port) when it exits,
    until ``stop``. The token reaches it in its environment, never on its command line."""

    def __init__(self, *, upstream: str, job_id: str, token: str, spool_dir: str, interval_s: float = 1.0):
        from trainer.ports import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.restarts = 0
        self._argv = [sys.executable, "-m", "trainer.agent", "--upstream", upstream, "--job-id", str(job_id),
                      "--port", str(self.port), "--spool-dir", spool_dir, "--interval-s", str(interval_s)]
        self._env = {**os.environ, "UNBROKEN_TOKEN": token}
        self._proc: Any = None
        self._stopping = threading.Event()

    def start(self) -> AgentProcess:
        self._spawn()
        threading.Thread(target=self._keep, name="agent-keeper", daemon=True).start()
        return self

    def _spawn(self) -> None:
        import subprocess

        self._proc = subprocess.Popen(self._argv, env=self._env, stdout=subprocess.DEVNULL, start_new_session=True)

    def _keep(self) -> None:
        while not self._stopping.wait(0.2):
            rc = self._proc.poll()
            if rc is not None and not self._stopping.is_set():
                self.restarts += 1
                log.warning("node agent exited with status %s; starting it again (ranks post directly meanwhile)",
                            rc)
                time.sleep(min(5.0, 0.2 * self.restarts))
                self._spawn()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def kill(self) -> None:
        """SIGKILL the agent (drills and tests): the keeper starts a new one."""
        self._proc.kill()

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM: the agent stops taking batches and sends what it spooled (the rest stays on disk)."""
        self._stopping.set()
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout_s)
            except Exception:  # noqa: BLE001 - hung: kill; its spool stays for the next agent of this node
                self._proc.kill()
                self._proc.wait()


def _handler(agent: NodeAgent) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # the http.server hook
            m = PATH.match(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            if m is None:
                self._answer(404, {"error": "POST /api/v1/jobs/<id>/ingest", "field": None})
                return
            if length > MAX_BODY_BYTES:
                self._answer(413, {"error": f"the body is over {MAX_BODY_BYTES} bytes", "field": None})
                return
            body = self.rfile.read(length)
            status, payload = agent.take(m[1], self.headers.get("Authorization", "").encode("latin-1"), body)
            self._answer(status, payload)

        def do_GET(self) -> None:  # the http.server hook
            m = COMMANDS_PATH.match(self.path)
            if m is None:
                self._answer(404, {"error": "GET /api/v1/jobs/<id>/commands", "field": None})
                return
            self._answer(*agent.poll(m[1], self.headers.get("Authorization", "").encode("latin-1")))

        def _answer(self, status: int, payload: dict[str, Any]) -> None:
            body = json.dumps(payload, separators=(",", ":")).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args: Any) -> None:  # no access log
            pass

    return Handler


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.agent", description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream", required=True, help="the control plane's URL")
    p.add_argument("--job-id", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: any free port (printed on stdout)")
    p.add_argument("--spool-dir", required=True)
    p.add_argument("--interval-s", type=float, default=1.0)
    ns = p.parse_args(argv)
    token = os.environ.get("UNBROKEN_TOKEN", "")
    if not token:
        print("trainer.agent: set UNBROKEN_TOKEN (the job's ingest token; never on a command line)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    agent = NodeAgent(upstream=ns.upstream, job_id=ns.job_id, token=token, spool_dir=ns.spool_dir,
                      interval_s=ns.interval_s, host=ns.host, port=ns.port).start()
    print(f"listening {agent.url}", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    done.wait()
    agent.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
