"""Celery adapters for launcher workflows: ids in, one service call, retries owned here.

These run on the ``launch`` queue (settings.CELERY_TASK_ROUTES) so a slow cluster API never
delays the watchdog on the default queue.
"""

from celery import shared_task

from controlplane.launchers import services
from controlplane.launchers.base import LaunchError, TransientLaunchError

RETRY = {"autoretry_for": (TransientLaunchError,), "retry_backoff": 2, "retry_backoff_max": 60,
         "retry_jitter": True, "max_retries": 6}


@shared_task(throws=(LaunchError,), **RETRY)
def launch(job_id: int) -> None:
    services.launch_job_now(job_id=job_id)


@shared_task(throws=(LaunchError,), **RETRY)
def stop(job_id: int, command_id: int | None) -> None:
    services.stop_job_now(job_id=job_id, command_id=command_id)


@shared_task(throws=(LaunchError,), **RETRY)
def restart(job_id: int, command_id: int | None) -> None:
    services.restart_job_now(job_id=job_id, command_id=command_id)


@shared_task(throws=(LaunchError,), **RETRY)
def hold(job_id: int) -> None:
    services.hold_job_now(job_id=job_id)


@shared_task(ignore_result=True)
def supervise() -> None:
    services.supervise_all()


def on_launcher_requested(*, action: str, job_id: int, command_id: int | None, countdown: float, **_) -> None:
    """The receiver of ``jobs.launcher_port.launcher_requested`` (connected in LaunchersConfig.ready)."""
    if action == "launch":
        launch.delay(job_id)
    elif action == "restart":
        restart.delay(job_id, command_id)
    elif action == "stop":
        stop.apply_async((job_id, command_id), countdown=countdown)
    elif action == "hold":
        hold.delay(job_id)
    else:
        raise ValueError(f"unknown launcher request {action!r}: use launch, restart, stop or hold")
