"""Run the control plane: web server, Celery worker and Celery beat, until Ctrl-C.

Each child runs in its own process group; on SIGINT/SIGTERM every group gets SIGTERM, then
SIGKILL after a grace period, so nothing this command started outlives it. Training jobs are not
children of this command (the local launcher detaches them): they keep running and are found
again by the next start.
"""

import os
import signal
import subprocess
import sys
import time

from django.conf import settings
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Start web + Celery worker + Celery beat; Ctrl-C stops all three."

    def add_arguments(self, parser):
        parser.add_argument("--host", default=os.environ.get("UNBROKEN_HOST", "127.0.0.1"))
        parser.add_argument("--port", type=int, default=int(os.environ.get("UNBROKEN_PORT", "8000")))
        parser.add_argument("--web-workers", type=int, default=int(os.environ.get("UNBROKEN_WEB_WORKERS", "2")))

    def handle(self, *args, host, port, web_workers, **options):
        py = sys.executable
        beat_schedule = settings.DATA_DIR / "celerybeat-schedule"
        cmds = {
            "web": [py, "-m", "uvicorn", "controlplane.asgi:application", "--host", host, "--port", str(port),
                    "--workers", str(web_workers), "--no-access-log", "--timeout-graceful-shutdown", "3"],
            "worker": [py, "-m", "celery", "-A", "controlplane", "worker", "-Q", "default,launch",
                       "--concurrency", "2", "--loglevel", "INFO", "--without-gossip", "--without-mingle"],
            "beat": [py, "-m", "celery", "-A", "controlplane", "beat", "--loglevel", "INFO",
                     "--schedule", str(beat_schedule)],
        }
        # Trainers the local launcher starts report to PUBLIC_URL: unless it is set, that is this server.
        env = dict(os.environ)
        if not os.environ.get("UNBROKEN_PUBLIC_URL"):
            reach = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
            env["UNBROKEN_PUBLIC_URL"] = f"http://{reach}:{port}"
        procs = {name: subprocess.Popen(cmd, start_new_session=True, env=env) for name, cmd in cmds.items()}
        stopping = False

        def stop(*_):
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        self.stdout.write(self.style.SUCCESS(
            f"\nUnbroken is up: http://{host}:{port}/  (log in as the operator; Ctrl-C stops everything)\n"))
        code = 0
        while not stopping:
            for name, p in procs.items():
                if p.poll() is not None:
                    self.stderr.write(f"{name} exited with code {p.returncode}; stopping the others")
                    stopping, code = True, 1
                    break
            time.sleep(0.3)
        for p in procs.values():
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(p.poll() is None for p in procs.values()):
            time.sleep(0.1)
        for p in procs.values():
            _signal_group(p, signal.SIGKILL)
            p.wait()
        self.stdout.write("Stopped web, worker and beat.")
        sys.exit(code)


def _signal_group(p, sig):
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass
