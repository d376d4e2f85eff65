"""A new user's own script from the web UI, with nothing faked: the new-job form takes the path of an
unmodified FSDP2 script and its arguments, the job runs it under ft_launcher, and the open job page
shows what ran, its integration level and versions, the drill's kill and the in-job restart."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from controlplane.jobs.models import Job, RestartCycle
from tests.helpers import end_job, wait_for
from trainer.wire import Layer

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

EXAMPLE = Path(__file__).resolve().parents[2] / "trainer" / "examples" / "plain_fsdp.py"


def test_it_runs_ones_own_script_from_the_form(e2e_settings, celery_beat_thread, live_server, operator_page, shot,
                                               tmp_path):
    project = tmp_path / "my-project"
    project.mkdir()
    shutil.copy(EXAMPLE, project / "train.py")  # "my" script: nothing of Unbroken in it
    base = live_server.url
    page = operator_page
    errors = page.errors
    job = None
    try:
        page.goto(f"{base}/jobs/new/?preset=own-script")
        page.fill("#id_name", "my script")
        page.fill("#id_entrypoint", "missing.py")
        page.fill("#id_working_dir", str(project))
        page.click("form.jobform button[type=submit]")
        page.locator("dialog.confirm-dialog [data-confirm-ok]").click()
        page.get_by_text("does not exist in").first.wait_for(timeout=15_000)  # refused before it is stored
        assert not Job.objects.exists()
        shot(page, "own-01-missing-script")

        page.fill("#id_entrypoint", "train.py")
        page.fill("#id_args", "--steps 300")
        page.fill("#id_drills", "100:sigkill:1")
        page.click("form.jobform button[type=submit]")
        page.locator("dialog.confirm-dialog [data-confirm-ok]").click()
        page.wait_for_url(f"{base}/jobs/*/", timeout=15_000)
        job = Job.objects.get()
        assert job.job_spec.entrypoint == "train.py" and job.job_spec.args == ("--steps", "300")

        page.locator("[data-testid=job-code]").get_by_text("train.py --steps 300").wait_for(timeout=10_000)
        page.locator("[data-testid=job-integration]").get_by_text("level 0").wait_for(timeout=120_000)
        page.locator("[data-testid=job-integration]").get_by_text("torch 2.").wait_for(timeout=10_000)
        page.locator("[data-testid=fault-table]").get_by_text("process_killed").first.wait_for(timeout=120_000)
        wait_for(lambda: RestartCycle.objects.filter(job=job, layer=Layer.IN_JOB, first_step_at__isnull=False).exists(),
                 timeout_s=90, what="the in-job restart to reach its first step")
        page.locator("[data-testid=job-status]").get_by_text("succeeded").wait_for(timeout=180_000)
        shot(page, "own-02-succeeded")
        assert page.locator("[data-testid=no-ledger]").count() == 1
        assert not errors, errors
    finally:
        if job is not None:
            end_job(job)
