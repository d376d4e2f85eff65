"""The live cursor: unchanged data is never re-sent; a new fact names the parts it changes."""

from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from controlplane.jobs.models import Checkpoint

from .factories import PASSWORD, make_command, make_cycle, make_fault, make_user, populated_job

pytestmark = pytest.mark.django_db


@pytest.fixture
def viewer(client):
    make_user("viewer")
    client.login(username="viewer", password=PASSWORD)
    return client


def poll(client, job, cursor=""):
    resp = client.get(reverse("dashboard:job_live", args=[job.pk]), {"c": cursor})
    assert resp.status_code == 200 and resp["Cache-Control"].startswith("max-age=0")
    return resp.json()


def test_it_sends_nothing_when_nothing_changed(viewer):
    job = populated_job(timezone.now())
    first = poll(viewer, job)
    assert "timeline" in first["changed"]  # an empty cursor gets everything
    again = poll(viewer, job, first["cursor"])
    assert again["changed"] == [] or again["changed"] == ["header", "goodput", "progress"]  # 5 s tick at most
    assert len(viewer.get(reverse("dashboard:job_live", args=[job.pk]), {"c": first["cursor"]}).content) < 200


def test_it_names_the_parts_a_new_fault_changes(viewer):
    now = timezone.now()
    job = populated_job(now)
    cursor = poll(viewer, job)["cursor"]
    make_fault(job, at=now, rank=0, fault_class="nan_loss", key="new")
    changed = set(poll(viewer, job, cursor)["changed"])
    assert {"timeline", "faults"} <= changed
    assert "commands" not in changed and "audit" not in changed and "checkpoints" not in changed


def test_it_notices_a_cycle_mark_filled_in_later(viewer):
    now = timezone.now()
    job = populated_job(now)
    cycle = make_cycle(job, "open", fault_at=now - timedelta(seconds=5), marks=(0.5, None))
    cursor = poll(viewer, job)["cursor"]
    cycle.aborted_at = now
    cycle.save()
    assert "timeline" in poll(viewer, job, cursor)["changed"]


def test_it_notices_a_checkpoint_becoming_durable(viewer):
    now = timezone.now()
    job = populated_job(now)
    ck = Checkpoint.objects.create(job=job, step=520, started_at=now, state="in_flight")
    cursor = poll(viewer, job)["cursor"]
    ck.state = "durable"
    ck.finished_at = now
    ck.save()
    assert "checkpoints" in poll(viewer, job, cursor)["changed"]


def test_it_notices_a_command_and_its_acknowledgement(viewer):
    job = populated_job(timezone.now())
    cursor = poll(viewer, job)["cursor"]
    cmd = make_command(job)
    r = poll(viewer, job, cursor)
    assert {"commands", "timeline"} <= set(r["changed"])
    cmd.status = "acked"
    cmd.acked_at = timezone.now()
    cmd.save()
    assert "commands" in poll(viewer, job, r["cursor"])["changed"]


def test_it_refetches_the_timeline_for_a_window(viewer):
    now = timezone.now()
    job = populated_job(now)
    start = int((now - timedelta(seconds=120)).timestamp() * 1000)
    end = int(now.timestamp() * 1000)
    resp = viewer.get(
        reverse("dashboard:job_part", args=[job.pk, "timeline"]), {"start": start, "end": end, "follow": "0"}
    )
    assert resp.status_code == 200
    assert f"[{start}, {end}]".replace(" ", "") in resp.content.decode().replace(" ", "")


def test_it_follows_the_jobs_list_with_a_cursor(viewer):
    job = populated_job(timezone.now())
    url = reverse("dashboard:jobs_live")
    cursor = viewer.get(url).json()["cursor"]
    assert viewer.get(url, {"c": cursor}).json()["changed"] == []
    job.status = "recovering"
    job.save()
    assert viewer.get(url, {"c": cursor}).json()["changed"] == ["table"]
