"""The demo flow in a real browser: log in, open a job, watch a fault arrive through the ingest API
without reloading, restart in-process with confirmation, see the command and its audit line.

The lead extends this to a real demo job with trainer processes; here the facts are posted to the
real ingest endpoint the way a trainer's reporter posts them.
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from django.contrib.auth.models import Group, User
from django.utils import timezone

from controlplane.jobs import heartbeats as hb_store
from controlplane.jobs.models import Command, Job, Rank
from controlplane.jobs.roles import OPERATORS_GROUP
from controlplane.jobs.spec import DEMO_SPEC

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

PASSWORD = "demo-operator-password"


def post_batch(base_url: str, job: Job, token: str, *, events=(), heartbeats=()) -> dict:
    body = json.dumps(
        {
            "v": 1,
            "sent_at": time.time(),
            "source": "browser-test",
            "events": list(events),
            "heartbeats": list(heartbeats),
        }
    ).encode()
    req = urllib.request.Request(
        f"{base_url}/api/v1/jobs/{job.pk}/ingest",
        data=body,
        method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        out = json.loads(resp.read())
    hb_store.get_store().flush()  # the Redis store writes Rank rows on its flush (a no-op for the database)
    return out


def beats(step: int) -> list[dict]:
    now = time.time()
    return [
        {
            "rank": r,
            "step": step,
            "phase": "train",
            "at": now,
            "loss": 5.0 - step / 100,
            "step_time_s": 0.2,
            "tokens_per_s": 4000.0,
            "node": "localhost",
            "pid": 1000 + r,
        }
        for r in range(2)
    ]


def test_it_shows_a_fault_live_and_restarts_in_process(live_server, browser, shot, docs_shot):
    user = User.objects.create_user("operator", password=PASSWORD)
    user.groups.add(Group.objects.get_or_create(name=OPERATORS_GROUP)[0])
    now = timezone.now()
    job = Job(
        name="demo",
        spec=DEMO_SPEC.to_dict(),
        backend="local",
        status="running",
        started_at=now,
        first_step_at=now,
        created_by=user,
    )
    token = job.issue_token()
    job.save()
    base = live_server.url
    post_batch(
        base,
        job,
        token,
        heartbeats=beats(40),
        events=[
            {
                "id": "ck-40",
                "kind": "checkpoint",
                "at": time.time(),
                "rank": 0,
                "data": {
                    "step": 40,
                    "mode": "async",
                    "state": "durable",
                    "blocking_s": 0.05,
                    "write_s": 0.4,
                    "bytes": 2_000_000,
                },
            }
        ],
    )
    assert Rank.objects.filter(job=job).count() == 2

    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{base}/login/")
    page.fill("#id_username", "operator")
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(f"{base}/")
    assert page.locator("table.jobs").get_by_text("demo").count() >= 1
    shot(page, "01-jobs-list")
    docs_shot(page, "tour-01-jobs", height=220)
    page.goto(f"{base}/jobs/new/?preset=demo")
    page.locator("form.jobform").wait_for()
    docs_shot(page, "tour-02-new-job")

    page.goto(f"{base}/jobs/{job.pk}/")
    page.wait_for_selector("#part-timeline .main-svg")
    shot(page, "02-job-page")
    docs_shot(page, "tour-03-job-page")
    assert page.locator("#part-timeline").get_by_text("fault · exception").count() == 0

    # A fault and its restart cycle arrive through the ingest API, as the trainer reports them.
    t = time.time()
    cycle = "a0-ij0-ip1"
    sent = time.monotonic()
    post_batch(
        base,
        job,
        token,
        heartbeats=beats(55),
        events=[
            {
                "id": "f-1",
                "kind": "fault",
                "at": t,
                "rank": 1,
                "data": {
                    "fault": "exception",
                    "cycle": cycle,
                    "message": "drill: exception at step 55",
                    "detected_by": "in_process",
                    "step": 55,
                },
            },
            {
                "id": "c-1",
                "kind": "cycle",
                "at": t,
                "rank": 1,
                "data": {"cycle": cycle, "mark": "fault_at", "layer": "in_process", "step": 55},
            },
            {
                "id": "c-2",
                "kind": "cycle",
                "at": t + 0.2,
                "rank": 1,
                "data": {"cycle": cycle, "mark": "detected_at", "layer": "in_process"},
            },
        ],
    )
    page.locator("#part-timeline").get_by_text("fault · exception").first.wait_for(timeout=5000)
    shown_after = time.monotonic() - sent
    page.locator("[data-testid=fault-table]").get_by_text("drill: exception at step 55").wait_for(
        timeout=5000
    )
    assert page.evaluate("performance.getEntriesByType('navigation').length") == 1  # no reload happened
    shot(page, "03-fault-live")
    docs_shot(page, "job-page-recovery")
    assert shown_after < 3.0, f"the fault took {shown_after:.2f} s to show"

    # Recovery completes; the band gets its durations.
    post_batch(
        base,
        job,
        token,
        heartbeats=beats(41),
        events=[
            {
                "id": f"c-{i}",
                "kind": "cycle",
                "at": t + off,
                "rank": 1,
                "data": {
                    "cycle": cycle,
                    "mark": mark,
                    "layer": "in_process",
                    **({"step": 40} if mark in ("restarted_at", "checkpoint_loaded_at") else {}),
                },
            }
            for i, (mark, off) in enumerate(
                [
                    ("aborted_at", 0.3),
                    ("restarted_at", 0.5),
                    ("checkpoint_loaded_at", 0.9),
                    ("first_step_at", 1.2),
                ],
                start=3,
            )
        ],
    )
    page.locator("#part-timeline").get_by_text("in-process").first.wait_for(timeout=5000)

    # A manual in-process restart, confirmed in the dialog.
    page.select_option("#restart-level", "in_process")
    page.click("[data-testid=restart]")
    dialog = page.locator("dialog.confirm-dialog")
    dialog.wait_for(state="visible")
    shot(page, "04-confirm-dialog")
    docs_shot(page, "tour-05-confirm")
    dialog.locator("[data-confirm-ok]").click()
    page.wait_for_load_state("load")
    page.locator("[data-testid=commands]").get_by_text("restart (in-process)").wait_for(timeout=5000)
    page.locator("[data-testid=audit]").get_by_text("job.restart").wait_for(timeout=5000)
    cmd = Command.objects.get(job=job)
    assert (cmd.kind, cmd.level, cmd.issued_by.username) == ("restart", "in_process", "operator")

    # The trainer acknowledges it; the status changes on the open page.
    post_batch(
        base,
        job,
        token,
        heartbeats=beats(42),
        events=[
            {
                "id": "ack-1",
                "kind": "command_ack",
                "at": time.time(),
                "rank": 0,
                "data": {"command_id": cmd.pk, "ok": True, "detail": "restarting in-process"},
            }
        ],
    )
    page.locator("[data-testid=commands] .cmd-acked").wait_for(timeout=5000)
    page.wait_for_selector("#part-timeline .main-svg")
    shot(page, "05-after-restart")
    docs_shot(page, "tour-06-after-restart", selector="#part-commands")

    page.set_viewport_size({"width": 390, "height": 844})
    page.reload()
    page.wait_for_selector("#part-timeline .main-svg")
    page.wait_for_timeout(500)
    shot(page, "06-narrow")
    assert not errors, errors
