"""The operator API and the job page show the same numbers for one job: goodput and its parts, steps
lost, detection and recovery times, the checkpoint ledger's figures, the ranks' steps."""

from __future__ import annotations

import time

import pytest
from django.contrib.auth.models import User

from controlplane.dashboard import words
from tests.controlplane.api import drill
from tests.controlplane.conftest import batch, hb, make_job

pytestmark = pytest.mark.django_db


@pytest.fixture()
def pages(client, post, settle):
    user = User.objects.create_user("op", password="x", is_superuser=True)
    job = drill.build(post, settle, user=user)  # finished: goodput no longer moves with the clock
    client.force_login(user)
    page = client.get(f"/jobs/{job.pk}/")
    assert page.status_code == 200
    return job, page.context, lambda tail="": client.get(f"/api/v1/jobs/{job.pk}{tail}").json()


def test_it_shows_the_pages_goodput(pages):
    _, page, api = pages
    g, shown = page["goodput"]["g"], api()["summary"]["goodput"]
    assert shown["goodput"] == g["goodput"] and shown["wall_s"] == g["wall_s"]
    for part in shown["shares"]:
        assert shown["shares"][part] == g[part], part
        assert shown["seconds"][part] == g[f"{part}_s"], part
    assert page["goodput"]["goodput_pct"] == round(100 * shown["goodput"], 1)
    assert [p["pct"] for p in page["goodput"]["parts"]] == [round(100 * shown["shares"][p["key"]], 1)
                                                             for p in page["goodput"]["parts"]]
    assert shown["shares"]["lost_work"] > 0 and shown["shares"]["recovery"] > 0


def test_it_shows_the_pages_fault_table(pages):
    _, page, api = pages
    by_id = {f["id"]: f for f in api("/faults")["faults"]}
    rows = page["faults"]["rows"]
    assert len(rows) == len(by_id) == 2
    for row in rows:
        f = by_id[row["f"].pk]
        assert row["lost"] == f["lost_steps"]
        assert row["detection"] == words.fmt_s(f["detection_s"])
        assert row["recovery"] == words.fmt_s(f["recovery_s"])
        assert row["layer"] == words.LAYER_NAMES[f["layer"]]
    assert sorted(r["lost"] for r in rows) == [10, 20]


def test_it_shows_the_pages_cycles_and_checkpoints(pages):
    _, page, api = pages
    cycles = {c["key"]: c for c in api("/cycles")["cycles"]}
    for row in page["faults"]["rows"]:  # the fault table shows its cycle's recovery and steps lost
        c = cycles[row["f"].cycle.key]
        assert (row["recovery"], row["lost"]) == (words.fmt_s(c["recovery_s"]), c["lost_steps"])
    ledger = api("/checkpoints")["checkpoints"]
    recent = page["ckpt"]["recent"]  # newest first
    assert [(r["step"], r["state"]) for r in recent] == [(c["step"], c["state"]) for c in reversed(ledger)]
    for r, c in zip(recent, reversed(ledger), strict=True):
        keys = ("blocking_s", "durable_s", "mb_per_s")
        assert [r[k] for k in keys] == [c[k] for k in keys]
    assert page["ckpt"]["counts"] == api()["summary"]["checkpoints"]


def test_it_shows_the_pages_ranks(pages):
    _, page, api = pages
    ranks = {r["rank"]: r for r in api("/ranks")["ranks"]}
    for row in page["ranks"]["rows"]:
        r = ranks[row["rank"]]
        assert (row["health"], row["step"], row["phase"], row["loss"], row["step_time_s"]) == (
            r["health"], r["step"], r["phase"], r["loss"], r["step_time_s"])


def test_a_running_jobs_step_is_its_newest_heartbeats_on_the_page_and_in_the_api(client, post):
    """Before any flush (the Redis store writes rows every few seconds; the CLI's bar reads this): the step
    of the newest beats, and after a rollback the lower one."""
    user = User.objects.create_user("op", password="x", is_superuser=True)
    job, token = make_job(spec={"steps": 200, "procs_per_node": 2})
    client.force_login(user)
    now = time.time()

    def shown():
        api = client.get(f"/api/v1/jobs/{job.pk}").json()
        page = client.get(f"/jobs/{job.pk}/").context
        return api["last_step"], api["progress_pct"], page["step"]

    assert shown() == (0, 0, 0)
    assert post(job, token, batch([hb(0, 63, at=now - 2), hb(1, 62, at=now - 2)])).status_code == 200
    assert shown() == (63, 32, 63)
    assert post(job, token, batch([hb(0, 41, at=now), hb(1, 41, at=now)])).status_code == 200  # a rollback
    assert shown() == (41, 20, 41)
