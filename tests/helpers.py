"""Small helpers shared by the end-to-end and browser tests."""

import contextlib
import os
import re
import time

import psutil


def wait_for(predicate, *, timeout_s: float, interval_s: float = 0.25, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def tagged_processes(tag: str | re.Pattern) -> list[int]:
    """Processes (other than this one) whose environment carries a local launch's tag (or one matching)."""
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            seen = p.environ().get("UNBROKEN_LAUNCH_TAG", "")
            if p.pid != os.getpid() and (tag.fullmatch(seen) if isinstance(tag, re.Pattern) else seen == tag):
                out.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def end_job(job, *, grace_s: float = 2.0) -> None:
    """End a test's local job for good. Its status is made final first: the supervisor still runs in the
    test's threads, and a launcher it finds gone is a lost node to it, so stopping only the processes made
    it relaunch the job (a new attempt that trained on, unwatched, into the tests after this one). Then the
    current attempt's processes are stopped and any process of any attempt of this job is killed."""
    import signal

    from controlplane.jobs.models import ACTIVE_STATUSES, Job, JobStatus
    from controlplane.launchers.local import LocalLauncher, launch_tag

    Job.objects.filter(pk=job.pk, status__in=ACTIVE_STATUSES).update(status=JobStatus.STOPPED)
    job.refresh_from_db()
    LocalLauncher().stop(job, grace_s=grace_s)
    home = launch_tag(job).rsplit("-", 1)[1]  # job<pk>-a<attempt>-<home>
    any_attempt = re.compile(rf"job{job.pk}-a\d+-{home}")
    for _ in range(2):  # a relaunch that raced the status update: its status, then its processes
        Job.objects.filter(pk=job.pk, status__in=ACTIVE_STATUSES).update(status=JobStatus.STOPPED)
        for pid in tagged_processes(any_attempt):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
