"""Operator actions: permissions, CSRF, confirmation, commands and audit entries."""

from unittest import mock

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from controlplane.jobs.models import AuditEntry, Command, Job

from .factories import PASSWORD, make_job, make_user

pytestmark = pytest.mark.django_db

ACTIONS = [
    ("dashboard:job_stop", {}),
    ("dashboard:job_restart", {"level": "in_process"}),
    ("dashboard:job_inject", {"fault": "exception", "rank": "1"}),
]


def login(username, *, operator=False, csrf=False) -> Client:
    make_user(username, operator=operator)
    c = Client(enforce_csrf_checks=csrf)
    assert c.login(username=username, password=PASSWORD)
    return c


@pytest.fixture(autouse=True)
def _no_celery():
    """The services enqueue launcher tasks on commit; no broker is needed to test the page."""
    with (
        mock.patch("controlplane.launchers.tasks.stop.apply_async"),
        mock.patch("controlplane.launchers.tasks.restart.delay"),
        mock.patch("controlplane.launchers.tasks.launch.delay"),
    ):
        yield


@pytest.mark.parametrize(("name", "data"), ACTIONS)
def test_it_forbids_viewers_to_act(name, data):
    job = make_job()
    c = login("viewer")
    resp = c.post(reverse(name, args=[job.pk]), {**data, "confirmed": "yes"})
    assert resp.status_code == 403
    assert not Command.objects.exists()


def test_it_forbids_viewers_to_start_jobs():
    c = login("viewer")
    assert c.get(reverse("dashboard:job_new")).status_code == 403
    assert c.post(reverse("dashboard:job_new"), {"name": "x", "confirmed": "yes"}).status_code == 403


@pytest.mark.parametrize(("name", "data"), ACTIONS)
def test_it_sends_anonymous_users_to_login(client, name, data):
    job = make_job()
    resp = client.post(reverse(name, args=[job.pk]), data)
    assert resp.status_code == 302
    assert resp["Location"].startswith(reverse("login"))


@pytest.mark.parametrize("url", ["dashboard:jobs", "dashboard:job_new"])
def test_it_sends_anonymous_page_views_to_login(client, url):
    resp = client.get(reverse(url))
    assert resp.status_code == 302 and resp["Location"].startswith(reverse("login"))


def test_it_sends_anonymous_job_page_and_live_views_to_login(client):
    job = make_job()
    for name in ("dashboard:job", "dashboard:job_live"):
        resp = client.get(reverse(name, args=[job.pk]))
        assert resp.status_code == 302 and resp["Location"].startswith(reverse("login"))


@pytest.mark.parametrize(("name", "data"), ACTIONS)
def test_it_enforces_csrf_on_actions(name, data):
    job = make_job()
    c = login("op", operator=True, csrf=True)
    resp = c.post(reverse(name, args=[job.pk]), {**data, "confirmed": "yes"})
    assert resp.status_code == 403
    assert not Command.objects.exists()


def test_it_accepts_an_action_with_the_csrf_token_from_the_page():
    job = make_job()
    c = login("op", operator=True, csrf=True)
    c.get(reverse("dashboard:job", args=[job.pk]))
    token = c.cookies["csrftoken"].value
    resp = c.post(
        reverse("dashboard:job_restart", args=[job.pk]),
        {"level": "in_process", "confirmed": "yes", "csrfmiddlewaretoken": token},
    )
    assert resp.status_code == 302
    assert Command.objects.filter(job=job, kind="restart", level="in_process").count() == 1


@pytest.mark.parametrize(("name", "data"), ACTIONS)
def test_it_asks_for_confirmation_before_acting(name, data):
    job = make_job()
    c = login("op", operator=True)
    resp = c.post(reverse(name, args=[job.pk]), data)
    assert resp.status_code == 200
    body = resp.content.decode()
    assert 'name="confirmed" value="yes"' in body and "csrfmiddlewaretoken" in body
    for k, v in data.items():
        assert f'name="{k}" value="{v}"' in body
    assert not Command.objects.exists()


def test_it_restarts_in_process_and_audits_it():
    job = make_job()
    c = login("op", operator=True)
    resp = c.post(
        reverse("dashboard:job_restart", args=[job.pk]), {"level": "in_process", "confirmed": "yes"}
    )
    assert resp.status_code == 302 and resp["Location"] == reverse("dashboard:job", args=[job.pk])
    cmd = Command.objects.get(job=job)
    assert (cmd.kind, cmd.level, cmd.issued_by.username) == ("restart", "in_process", "op")
    audit = AuditEntry.objects.get(job=job, action="job.restart")
    assert audit.actor_name == "op" and audit.remote_addr == "127.0.0.1"
    page = c.get(reverse("dashboard:job", args=[job.pk])).content.decode()
    assert "job.restart" in page and "restart (in-process)" in page


def test_it_restarts_the_whole_job_through_the_launcher():
    job = make_job()
    c = login("op", operator=True)
    c.post(reverse("dashboard:job_restart", args=[job.pk]), {"level": "job", "confirmed": "yes"})
    assert Command.objects.get(job=job).via_trainer is False


def test_it_injects_a_fault_into_a_rank():
    job = make_job()
    c = login("op", operator=True)
    c.post(
        reverse("dashboard:job_inject", args=[job.pk]), {"fault": "sigkill", "rank": "1", "confirmed": "yes"}
    )
    cmd = Command.objects.get(job=job)
    assert (cmd.kind, cmd.fault, cmd.rank) == ("inject_fault", "sigkill", 1)


def test_it_stops_a_job():
    job = make_job()
    c = login("op", operator=True)
    c.post(reverse("dashboard:job_stop", args=[job.pk]), {"confirmed": "yes"})
    assert Command.objects.get(job=job).kind == "stop"
    assert AuditEntry.objects.filter(job=job, action="job.stop").exists()


def test_it_shows_why_an_action_was_refused():
    job = make_job(status="succeeded", finished_at=timezone.now())
    c = login("op", operator=True)
    resp = c.post(
        reverse("dashboard:job_inject", args=[job.pk]),
        {"fault": "hang", "rank": "0", "confirmed": "yes"},
        follow=True,
    )
    assert "only a running job takes commands" in resp.content.decode()
    assert not Command.objects.exists()


def test_it_rejects_a_rank_outside_the_job():
    job = make_job()
    c = login("op", operator=True)
    resp = c.post(
        reverse("dashboard:job_inject", args=[job.pk]),
        {"fault": "hang", "rank": "9", "confirmed": "yes"},
        follow=True,
    )
    assert "rank 9 is not in this job" in resp.content.decode()


def test_it_starts_the_demo_preset_after_confirmation():
    from controlplane.dashboard.forms import JobForm
    from controlplane.jobs.spec import DEMO_SPEC

    c = login("op", operator=True)
    data = {k: v for k, v in JobForm.initial_for(DEMO_SPEC, name="demo").items() if v not in (False, None)}
    first = c.post(reverse("dashboard:job_new"), data)
    assert first.status_code == 200 and b"Start job" in first.content and not Job.objects.exists()
    resp = c.post(reverse("dashboard:job_new"), {**data, "confirmed": "yes"})
    job = Job.objects.get()
    assert resp["Location"] == reverse("dashboard:job", args=[job.pk])
    assert job.job_spec == DEMO_SPEC
    assert AuditEntry.objects.filter(job=job, action="job.create", actor_name="op").exists()


def test_it_shows_spec_errors_next_to_their_fields():
    from controlplane.dashboard.forms import JobForm
    from controlplane.jobs.spec import DEMO_SPEC

    c = login("op", operator=True)
    data = {k: v for k, v in JobForm.initial_for(DEMO_SPEC, name="demo").items() if v not in (False, None)}
    data.update(nodes=2, step_timeout_s=0.5, drills="60:explode:1", confirmed="yes")
    resp = c.post(reverse("dashboard:job_new"), data)
    assert resp.status_code == 400
    form = resp.context["form"]
    assert "local backend runs on this machine" in form.errors["nodes"][0]
    assert "twice heartbeat_interval_s" in form.errors["step_timeout_s"][0]
    assert "must be one of" in form.errors["drills"][0]
    assert 'id="id_nodes-error"' in resp.content.decode()
    assert not Job.objects.exists()


def test_it_validates_kubernetes_fields_only_for_that_backend():
    from controlplane.dashboard.forms import JobForm
    from controlplane.jobs.spec import DEMO_SPEC

    c = login("op", operator=True)
    data = {k: v for k, v in JobForm.initial_for(DEMO_SPEC, name="k").items() if v not in (False, None)}
    data.update(backend="kubernetes", nodes=2, k8s_namespace="Bad_NS", k8s_tolerations="{not json", drills="")
    resp = c.post(reverse("dashboard:job_new"), data)
    assert resp.status_code == 400
    assert "tolerations" in str(resp.context["form"].errors) or "namespace" in str(
        resp.context["form"].errors
    )
    data.update(k8s_tolerations="[]")
    resp = c.post(reverse("dashboard:job_new"), data)
    assert "DNS label" in resp.context["form"].errors["k8s_namespace"][0]
    data.update(k8s_namespace="team-a", backend="local", nodes=1)  # k8s fields ignored for local
    data["k8s_tolerations"] = "{still not json"
    assert c.post(reverse("dashboard:job_new"), data).status_code == 200


def test_it_shows_launcher_preflight_problems_in_the_form():
    from controlplane.dashboard.forms import JobForm
    from controlplane.jobs.spec import DEMO_SPEC

    c = login("op", operator=True)
    data = {k: v for k, v in JobForm.initial_for(DEMO_SPEC, name="big").items() if v not in (False, None)}
    data.update(preset="1b", confirmed="yes")
    resp = c.post(reverse("dashboard:job_new"), data)
    assert resp.status_code == 400
    assert "Cannot launch: preset &#x27;1b&#x27; needs GPUs" in resp.content.decode()
    assert not Job.objects.exists()


def test_it_explains_a_missing_cluster_configuration(settings):
    from controlplane.dashboard.forms import JobForm
    from controlplane.jobs.spec import DEMO_SPEC

    settings.KUBECONFIG = "/nonexistent/kubeconfig"
    c = login("op", operator=True)
    data = {k: v for k, v in JobForm.initial_for(DEMO_SPEC, name="k").items() if v not in (False, None)}
    data.update(backend="kubernetes", drills="", confirmed="yes")
    resp = c.post(reverse("dashboard:job_new"), data)
    assert resp.status_code == 400
    assert "no usable Kubernetes configuration" in resp.content.decode()
    assert not Job.objects.exists()


def test_a_finished_job_offers_to_start_again_instead_of_commands():
    job = make_job(status="succeeded", finished_at=timezone.now())
    c = login("op", operator=True)
    body = c.get(reverse("dashboard:job", args=[job.pk])).content.decode()
    for testid in ("restart", "inject", "stop"):
        assert f'data-testid="{testid}"' not in body
    assert f'href="/jobs/new/?from={job.pk}"' in body
    form = c.get(reverse("dashboard:job_new"), {"from": job.pk}).content.decode()
    assert 'data-testid="again-from"' in form and f'value="{job.spec["steps"]}"' in form
    running = make_job(status="running")
    body = c.get(reverse("dashboard:job", args=[running.pk])).content.decode()
    assert 'data-testid="restart"' in body and "start-again" not in body
