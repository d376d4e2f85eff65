"""The job's NVRx options are checked against the trainer's NVRx before launch (errors next to the field,
naming both versions), and the job page says which NVRx, torch and Python each attempt ran with."""

from unittest import mock

import pytest
from django.urls import reverse
from django.utils import timezone

from controlplane.dashboard.forms import PRESET_CHOICES, JobForm
from controlplane.jobs.models import Event, Job
from trainer import nvrx_compat
from trainer.wire import EventKind

from .factories import make_job, operator_client

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _no_celery():
    with mock.patch("controlplane.launchers.tasks.launch.delay"):
        yield


def test_the_form_checks_an_option_only_newer_nvrx_has_against_the_installed_release():
    """Local ranks run with this environment's NVRx: 0.4.1 refuses the no-progress limit, 0.6.0 takes it."""
    c = operator_client()
    data = {k: v for k, v in JobForm.initial_for(PRESET_CHOICES["demo"][2], name="np").items()
            if v not in (False, None)}
    data.update(max_no_progress_restarts="2", confirmed="yes")
    resp = c.post(reverse("dashboard:job_new"), data)
    if nvrx_compat.version() >= (0, 6, 0):
        assert resp.status_code == 302
        assert Job.objects.get().job_spec.max_no_progress_restarts == 2
        return
    assert resp.status_code == 400
    (error,) = resp.context["form"].errors["max_no_progress_restarts"]
    assert "needs NVRx 0.6.0 or later" in error and f"this job's NVRx is {nvrx_compat.version_str()}" in error
    assert not Job.objects.exists()


def test_the_job_page_says_what_each_attempt_ran_with():
    c = operator_client()
    job = make_job()
    url = reverse("dashboard:job", args=[job.pk])
    assert "Ran with" not in c.get(url).content.decode()
    for attempt, nvrx, node in ((0, "0.4.1", 0), (0, "0.4.1", 1), (1, "0.6.0", 0)):
        Event.objects.create(job=job, event_id=f"l{attempt}{node}", kind=EventKind.LAUNCHER, at=timezone.now(),
                             data={"message": "starting ft_launcher", "attempt": attempt, "nvrx": nvrx,
                                   "torch": "2.13.0", "python": "3.11.2"})
    page = c.get(url).content.decode()
    assert "attempt 1: NVRx 0.6.0 · torch 2.13.0 · Python 3.11.2" in page
    assert page.count("attempt 0: NVRx 0.4.1") == 1  # two nodes, one line
