"""Run the control plane: web server, Celery worker and Celery beat, until Ctrl-C or SIGTERM.

``controlplane.supervisor`` keeps them alive: a child that dies is logged and started again with
backoff; only SIGINT/SIGTERM stops them all (SIGTERM to each process group, SIGKILL after a grace
period), so nothing this command started outlives it. Training jobs are not children of this command
(the local launcher detaches them): they keep running and are found again by the next start.
"""

import os
import signal
import sys

from django.conf import settings
from django.core.management.base import BaseCommand

from controlplane.supervisor import Supervisor


class Command(BaseCommand):
    help = "Start web + Celery worker + Celery beat and keep them running; Ctrl-C stops all three."

    def add_arguments(self, parser):
        parser.add_argument("--host", default=os.environ.get("UNBROKEN_HOST", "127.0.0.1"))
        parser.add_argument("--port", type=int, default=int(os.environ.get("UNBROKEN_PORT", "8000")))
        parser.add_argument("--web-workers", type=int, default=int(os.environ.get("UNBROKEN_WEB_WORKERS", "2")))

    def handle(self, *args, host, port, web_workers, **options):
        py = sys.executable
        beat_schedule = settings.DATA_DIR / "celerybeat-schedule"
        cmds = {
            "web": [py, "-m", "uvicorn", "controlplane.asgi:application", "--host", host, "--port", str(port),
                    "--workers", str(web_workers), "--no-access-log", "--timeout-graceful-shutdown", "3",
                    # REMOTE_ADDR is the connection's: X-Forwarded-For must not choose it (/metrics,
                    # lockouts, audit).
                    "--no-proxy-headers"],
            "worker": [py, "-m", "celery", "-A", "controlplane", "worker", "-Q", "default,launch",
                       "--concurrency", "2", "--loglevel", "INFO", "--without-gossip", "--without-mingle"],
            "beat": [py, "-m", "celery", "-A", "controlplane", "beat", "--loglevel", "INFO",
                     "--schedule", str(beat_schedule)],
        }
        # Trainers the local launcher starts report to PUBLIC_URL: unless it is set, that is this server.
        env = dict(os.environ)
        if not os.environ.get("UNBROKEN_PUBLIC_URL"):
            reach = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host  # noqa: S104 - a comparison
            env["UNBROKEN_PUBLIC_URL"] = f"http://{reach}:{port}"
        sup = Supervisor(cmds, state_dir=settings.DATA_DIR, env=env)
        signal.signal(signal.SIGINT, sup.request_stop)
        signal.signal(signal.SIGTERM, sup.request_stop)
        self.stdout.write(self.style.SUCCESS(
            f"\nUnbroken is up: http://{host}:{port}/  (log in as the operator; Ctrl-C stops everything)\n"))
        sys.exit(sup.run())
