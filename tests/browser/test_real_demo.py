"""The whole product in a real browser, with nothing faked: an operator logs in, starts the demo
job from the new-job page (real trainer processes under ft_launcher and the NVRx Wrapper, a real
Celery worker and beat), watches the drill's fault and its in-process recovery appear on the open
job page without reloading, restarts the job in-process by hand, and sees it running again."""

from __future__ import annotations

import re
import time

import pytest

from controlplane.jobs.models import Command, Job, RestartCycle
from tests.browser.conftest import hover_text
from tests.helpers import end_job, wait_for
from trainer.wire import Layer

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_it_runs_the_demo_job_and_a_manual_restart_live(e2e_settings, celery_beat_thread, live_server,
                                                        operator_page, shot):
    base = live_server.url
    page = operator_page
    errors = page.errors
    job = None
    try:
        page.goto(f"{base}/jobs/new/?preset=demo")
        page.click("form.jobform button[type=submit]")
        dialog = page.locator("dialog.confirm-dialog")
        dialog.wait_for(state="visible")
        dialog.locator("[data-confirm-ok]").click()
        page.wait_for_url(f"{base}/jobs/*/", timeout=15000)
        job = Job.objects.get()
        page.wait_for_selector("#part-timeline .main-svg")
        shot(page, "real-01-started")

        # The demo's first drill (an exception in rank 1) shows up live, then its in-process recovery.
        status = page.locator("[data-testid=job-status]")
        status.get_by_text("running").wait_for(timeout=120_000)
        page.locator("#part-timeline").get_by_text("fault · exception").first.wait_for(timeout=240_000)
        page.locator("[data-testid=fault-table]").get_by_text("exception").first.wait_for(timeout=10_000)
        wait_for(lambda: RestartCycle.objects.filter(job=job, layer=Layer.IN_PROCESS,
                                                     first_step_at__isnull=False).exists(),
                 timeout_s=60, what="the drill's in-process recovery to complete")
        assert page.evaluate("performance.getEntriesByType('navigation').length") == 1  # never reloaded
        shot(page, "real-02-drill-recovered")

        # One detection time for the drill's fault: the fault table's and the marker's hover agree.
        page.locator("[data-testid=fault-table] tbody tr").filter(has_text="exception").first.wait_for()
        headers = page.locator("[data-testid=fault-table] thead th").all_inner_texts()
        row = page.locator("[data-testid=fault-table] tbody tr").filter(has_text="exception").first
        table_detection = row.locator("td").nth(headers.index("Detection")).inner_text().strip()
        hover = hover_text(page, "fault · exception")
        assert re.search(r"after ([\d.]+ m?s|[\d.]+ min)", hover).group(1) == table_detection, (hover, table_detection)

        # A manual in-process restart, confirmed in the dialog, acknowledged by the trainer.
        before = RestartCycle.objects.filter(job=job, layer=Layer.IN_PROCESS).count()
        page.select_option("#restart-level", "in_process")
        page.click("[data-testid=restart]")
        dialog.wait_for(state="visible")
        dialog.locator("[data-confirm-ok]").click()
        page.wait_for_load_state("load")
        page.locator("[data-testid=commands] .cmd-acked").wait_for(timeout=60_000)
        cmd = Command.objects.get(job=job, kind="restart")
        assert (cmd.level, cmd.issued_by.username) == ("in_process", "operator")
        wait_for(lambda: RestartCycle.objects.filter(job=job, layer=Layer.IN_PROCESS,
                                                     first_step_at__isnull=False).count() > before,
                 timeout_s=60, what="the manual in-process restart to reach its first step")
        status.get_by_text("running").wait_for(timeout=30_000)
        page.locator("[data-testid=audit]").get_by_text("job.restart").wait_for(timeout=10_000)
        time.sleep(1.0)
        shot(page, "real-03-manual-restart")
        assert not errors, errors
    finally:
        if job is not None:
            end_job(job)
