"""Pages render with data, for viewers and operators; fragments render on their own."""

import pytest
from django.urls import reverse
from django.utils import timezone

from controlplane.dashboard.parts.signatures import JOB_SECTIONS

from .factories import PASSWORD, make_command, make_job, make_user, populated_job

pytestmark = pytest.mark.django_db


@pytest.fixture
def viewer_client(client):
    make_user("viewer")
    client.login(username="viewer", password=PASSWORD)
    return client


@pytest.fixture
def operator_client(client):
    make_user("op", operator=True)
    client.login(username="op", password=PASSWORD)
    return client


def test_it_renders_the_jobs_list_with_status_progress_restarts_goodput(viewer_client):
    now = timezone.now()
    job = populated_job(now)
    make_job(name="pending-one", status="pending", started_at=None, first_step_at=None, last_step=0)
    resp = viewer_client.get(reverse("dashboard:jobs"))
    assert resp.status_code == 200
    body = resp.content.decode()
    assert f"#{job.pk} test" in body
    assert "running" in body and "pending-one" in body
    assert "100 / 400" in body  # step and progress
    assert "Restarts (in-process · in-job · job)" in body
    assert 'data-age-since="' in body  # age of the last durable checkpoint ticks on the page
    assert "New job" not in body  # viewers do not get the start button


def test_it_renders_the_job_page_with_every_part(viewer_client):
    now = timezone.now()
    job = populated_job(now, ranks=4)
    make_command(job, user=None)
    resp = viewer_client.get(reverse("dashboard:job", args=[job.pk]))
    assert resp.status_code == 200
    body = resp.content.decode()
    for name in JOB_SECTIONS:
        assert f'data-part="{name}"' in body
    for needle in (
        "Recovery timeline",
        "timeline-data",
        "Checkpoint latency",
        "Fault history",
        "Goodput",
        "How goodput is defined",
        "Rank health",
        "Commands",
        "Audit log",
        "Log tail",
        "hang",
        "exception",
    ):
        assert needle in body, needle
    assert "<script>" not in body  # no inline scripts: data travels in json_script blocks
    assert "Actions" not in body  # viewers see no action forms


def test_it_shows_action_forms_to_operators(operator_client):
    job = populated_job(timezone.now())
    body = operator_client.get(reverse("dashboard:job", args=[job.pk])).content.decode()
    assert reverse("dashboard:job_restart", args=[job.pk]) in body
    assert reverse("dashboard:job_inject", args=[job.pk]) in body
    assert reverse("dashboard:job_stop", args=[job.pk]) in body
    assert "data-confirm" in body


@pytest.mark.parametrize("name", JOB_SECTIONS)
def test_it_renders_each_fragment_on_its_own(viewer_client, name):
    job = populated_job(timezone.now())
    resp = viewer_client.get(reverse("dashboard:job_part", args=[job.pk, name]))
    assert resp.status_code == 200
    assert b"<html" not in resp.content


def test_it_renders_a_job_with_no_facts_yet(viewer_client):
    job = make_job(
        status="launching", started_at=None, first_step_at=None, last_step=0, last_progress_at=None
    )
    resp = viewer_client.get(reverse("dashboard:job", args=[job.pk]))
    assert resp.status_code == 200
    body = resp.content.decode()
    # Empty states say what they wait for: no fake axes, no "?" lanes, health says why it is unknown.
    assert "Waiting for the first heartbeat" in body and "Waiting for the first checkpoint" in body
    assert 'data-chart="progress-data"' not in body and 'data-chart="ckpt-data"' not in body
    assert "· ?" not in body and "no heartbeat yet" in body
    assert "data-live-indicator" in body


def test_it_renders_a_finished_job_as_finished(viewer_client):
    from django.utils import timezone

    failed = make_job(status="failed", started_at=None, first_step_at=None, last_step=0,
                      last_progress_at=None, finished_at=timezone.now())
    body = viewer_client.get(reverse("dashboard:job", args=[failed.pk])).content.decode()
    assert "Waiting for" not in body and "data-live-indicator" not in body
    assert "the job ended before its ranks reported training" in body
    done = make_job(status="succeeded", last_step=0, max_step=100, finished_at=timezone.now())
    body = viewer_client.get(reverse("dashboard:job", args=[done.pk])).content.decode()
    assert "100 / " in body and "(highest reached)" in body and "data-live-indicator" not in body


def test_it_filters_and_paginates_the_fault_table(viewer_client):
    from datetime import timedelta

    from .factories import make_fault

    now = timezone.now()
    job = make_job(now=now)
    for i in range(30):
        make_fault(
            job, at=now - timedelta(seconds=300 - i), rank=i % 2, fault_class="exception" if i % 3 else "hang"
        )
    url = reverse("dashboard:job_part", args=[job.pk, "faults"])
    page1 = viewer_client.get(url).content.decode()
    assert "page 1 of 2" in page1 and "(30 faults)" in page1
    hangs = viewer_client.get(url, {"fault_class": "hang"}).content.decode()
    assert hangs.count('<span class="badge fault">hang</span>') == 10
    assert '<span class="badge fault">exception</span>' not in hangs
    rank1 = viewer_client.get(url, {"rank": "1", "page": "1"}).content.decode()
    assert rank1.count("<tr><td><a href=") == 15


def test_it_shows_the_log_tail_gracefully_when_there_is_none(viewer_client):
    job = make_job()
    body = viewer_client.get(reverse("dashboard:job_part", args=[job.pk, "log"])).content.decode()
    assert "no log yet" in body or "not available" in body


def test_it_shows_the_log_tail_of_a_local_job(viewer_client, tmp_path):
    log = tmp_path / "job.log"
    log.write_text("step 1 loss 7.0\nstep 2 loss 6.5\n")
    job = make_job(launcher_state={"log": str(log)})
    body = viewer_client.get(reverse("dashboard:job_part", args=[job.pk, "log"])).content.decode()
    assert "step 2 loss 6.5" in body


def test_it_serves_plotly_from_the_installed_package(viewer_client):
    from controlplane.dashboard.assets import PLOTLY_VERSION

    resp = viewer_client.get(
        reverse("dashboard:plotly_js", args=[PLOTLY_VERSION]), HTTP_ACCEPT_ENCODING="gzip"
    )
    assert resp.status_code == 200
    assert resp["Content-Encoding"] == "gzip"
    assert "immutable" in resp["Cache-Control"]


def test_it_renders_the_new_job_form_with_the_demo_preset(operator_client):
    body = operator_client.get(reverse("dashboard:job_new")).content.decode()
    assert "300:exception:1" in body and "900:sigkill:0" in body  # DEMO_SPEC drills
    assert 'data-show-for-backend="kubernetes"' in body


@pytest.mark.parametrize("preset", ["demo", "cpu-small", "k8s-1b"])
def test_it_prefills_every_preset(operator_client, preset):
    resp = operator_client.get(reverse("dashboard:job_new"), {"preset": preset})
    assert resp.status_code == 200
    form = resp.context["form"]
    assert form.initial["name"] == preset
    if preset == "k8s-1b":
        assert form.initial["backend"] == "kubernetes" and form.initial["k8s_namespace"] == "unbroken"


def test_it_draws_loss_history_from_training_samples(viewer_client):
    from datetime import timedelta

    from controlplane.jobs.models import TrainingSample

    now = timezone.now()
    job = make_job()
    for i in range(5):
        TrainingSample.objects.create(job=job, at=now - timedelta(seconds=10 - 2 * i), rank=0, step=10 + i,
                                      loss=6.0 - i / 10, tokens_per_s=1000.0 + i)
    body = viewer_client.get(reverse("dashboard:job_part", args=[job.pk, "progress"])).content.decode()
    assert 'id="loss-data"' in body
    assert "5.6" in body  # the newest loss value is in the figure data
