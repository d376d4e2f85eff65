"""Fixtures for the trainer tests: a stdlib ingest sink and a runner for real launches (gloo on CPU)."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from trainer import nvrx_compat
from trainer.ports import free_port, free_port_block

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable


class Receiver:
    """Stands in for the control plane's ingest endpoint as a sink: records batches, serves commands,
    can answer with a chosen status, and can be stopped and started again on the same port."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.batches: list[dict[str, Any]] = []
        self.commands: list[dict[str, Any]] = []
        self.status = 200
        self.delay_s = 0.0
        self.lock = threading.Lock()
        self._server: http.server.ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Receiver:
        recv = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if recv.delay_s:
                    time.sleep(recv.delay_s)
                status = recv.status
                if status == 200:
                    batch = json.loads(body)
                    batch["_auth"] = self.headers.get("Authorization")
                    batch["_path"] = self.path
                    batch["_received_at"] = time.time()
                    with recv.lock:
                        recv.batches.append(batch)
                        acked = {e["data"].get("command_id") for b in recv.batches for e in b.get("events", [])
                                 if e["kind"] == "command_ack"}
                        cmds = [c for c in recv.commands if c["id"] not in acked]  # re-sent until acked
                    out = json.dumps({"accepted": {}, "commands": cmds, "server_time": time.time()}).encode()
                else:
                    out = json.dumps({"error": "refused by test", "field": "events[0].kind"}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        http.server.ThreadingHTTPServer.allow_reuse_address = True
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        with self.lock:
            evs = [e for b in self.batches for e in b.get("events", [])]
        return [e for e in evs if kind is None or e["kind"] == kind]

    def heartbeats(self) -> list[dict[str, Any]]:
        with self.lock:
            return [h for b in self.batches for h in b.get("heartbeats", [])]


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UNBROKEN_", "TORCHELASTIC_", "FT_"))}
    env.update(OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR", PYTHONUNBUFFERED="1",
               PYTHONPATH=nvrx_compat.child_pythonpath([str(ROOT), str(ROOT / "trainer")],
                                                       os.environ.get("PYTHONPATH")), **extra)
    return env


@dataclass
class Run:
    rc: int
    log: str
    run_dir: Path
    wall_s: float
    events: list[dict[str, Any]] = field(default_factory=list)

    def final_loss(self) -> float | None:
        for line in self.log.splitlines():
            if line.startswith("FINAL_LOSS"):
                return float(line.split()[1])
        return None


def launch_command(run_dir: Path, *, trainer_flags: list[str], nproc: int = 2, in_job: bool = True,
                   max_restarts: int = 2, report_url: str | None = None, attempt: int = 0,
                   job_id: str = "job-1", token: str = "t0ken", env: dict[str, str] | None = None,
                   entrypoint: str | None = None, user_args: list[str] | None = None,
                   report_interval: float = 0.2) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of ``launch`` (for a caller that runs it itself)."""
    port = free_port_block()
    cmd = [PYTHON, "-m", "trainer.launch", "--nnodes", "1", "--node-rank", "0", "--nproc-per-node", str(nproc),
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", str(max_restarts),
           "--in-job" if in_job else "--no-in-job", "--run-dir", str(run_dir), "--job-id", job_id,
           "--attempt", str(attempt)]
    if entrypoint:
        cmd += ["--entrypoint", entrypoint]
    cmd += ["--", "--log-every", "0", *trainer_flags]
    if report_url:
        cmd += ["--report-url", report_url, "--report-interval", str(report_interval)]
    if entrypoint:
        cmd += ["--", *(user_args or [])]
    return cmd, child_env(UNBROKEN_TOKEN=token, **(env or {}))


def launch(run_dir: Path, *, timeout_s: float = 240, **kw: Any) -> Run:
    """``trainer.launch`` of the built-in model, or of ``entrypoint`` (the user's code) with ``user_args``
    (the keywords of ``launch_command``)."""
    cmd, env = launch_command(run_dir, **kw)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        out += "\n<<TIMEOUT>>"
    return Run(rc=proc.returncode, log=out, run_dir=run_dir, wall_s=time.monotonic() - t0)


def spec_flags(spec: Any) -> list[str]:
    """The trainer flags of a hand launch (``launch``) with ``spec``'s settings, for the benchmarks that drive
    the launcher by flags (the control plane hands the spec whole: ``spec_command``)."""
    def num(x: float) -> str:
        return str(int(x)) if float(x).is_integer() else repr(float(x))

    args = ["--preset", spec.preset, "--in-process" if spec.in_process else "--no-in-process",
            "--steps", str(spec.steps), "--ckpt-interval", str(spec.checkpoint_interval),
            "--ckpt-mode", spec.checkpoint_mode, "--keep-ckpts", str(spec.keep_checkpoints),
            "--step-timeout", num(spec.step_timeout_s), "--ckpt-timeout", num(spec.checkpoint_timeout_s),
            "--startup-timeout", num(spec.startup_timeout_s), "--max-in-process-restarts",
            str(spec.max_in_process_restarts), "--straggler-window", num(spec.straggler_window_s)]
    if spec.local_checkpoint_copy and spec.checkpoint_mode == "async":
        args += ["--local-ckpt-dir", "/dev/shm/unbroken"]
    return args + [a for d in spec.drills for a in ("--drill", d.as_flag())]


def spec_command(run_dir: Path, spec: Any, *, report_url: str = "", job_id: str = "job-1",
                 token: str = "t0ken", env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The command line and environment the control plane's launchers give ``trainer.launch`` for ``spec``
    (a ``JobSpec``): the spec whole in one variable, identity in flags."""
    from controlplane.launchers.command import launch_args, launch_env

    argv = launch_args(spec, node_rank=0, rdzv_endpoint=f"127.0.0.1:{free_port_block()}",
                       run_dir=str(run_dir), job_id=job_id, attempt=0, report_url=report_url)
    env = child_env(UNBROKEN_TOKEN=token, **launch_env(spec), **(env or {}))
    return [PYTHON, "-m", "trainer.launch", *argv], env


def launch_spec(run_dir: Path, spec: Any, *, timeout_s: float = 240, **kw: Any) -> Run:
    """``trainer.launch`` as the control plane starts it for ``spec`` (the keywords of ``spec_command``)."""
    cmd, env = spec_command(run_dir, spec, **kw)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        out += "\n<<TIMEOUT>>"
    return Run(rc=proc.returncode, log=out, run_dir=run_dir, wall_s=time.monotonic() - t0)


@pytest.fixture
def receiver():
    r = Receiver().start()
    yield r
    r.stop()
