"""The new-job form takes one's own script; the job page says what was run, at which integration level,
and what that level cannot show."""

from unittest import mock

import pytest
from django.urls import reverse
from django.utils import timezone

from controlplane.dashboard.forms import EXAMPLE_SCRIPT, PRESET_CHOICES, JobForm
from controlplane.jobs import launcher_port, services
from controlplane.jobs.models import Event, Job
from controlplane.jobs.spec import JobSpec
from trainer.wire import EventKind

from .factories import make_fault, make_job, operator_client

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _no_celery():
    with mock.patch("controlplane.launchers.tasks.launch.delay"):
        yield


def _form_data(spec: JobSpec, **changes) -> dict:
    data = {k: v for k, v in JobForm.initial_for(spec, name="mine").items() if v not in (False, None)}
    data.update(changes)
    return data


def test_it_starts_ones_own_script_with_arguments_and_environment(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('step 1 loss 2.0')\n")
    c = operator_client()
    data = _form_data(PRESET_CHOICES["own-script"][2], entrypoint="train.py", working_dir=str(tmp_path),
                      args="--steps 300 --note 'two words'", env="MY_FLAG=1\nDATA=/data/x", confirmed="yes")
    resp = c.post(reverse("dashboard:job_new"), data)
    assert resp.status_code == 302, resp.context["form"].errors if resp.context else resp
    spec = Job.objects.get().job_spec
    assert (spec.entrypoint, spec.working_dir) == ("train.py", str(tmp_path))
    assert spec.args == ("--steps", "300", "--note", "two words")
    assert spec.env == {"MY_FLAG": "1", "DATA": "/data/x"}
    assert spec.in_process is False


@pytest.mark.parametrize("changes, field, message", [
    ({"entrypoint": "missing.py"}, None, "does not exist in"),
    ({"env": "HF_TOKEN=abc"}, "env", "looks like a secret"),
    ({"env": "RANK=3"}, "env", "set by the launcher"),
    ({"args": "--name 'unterminated"}, "args", "cannot split it like a command line"),
    ({"drills": "50:nan_loss:0"}, "drills", "your own script can be drilled with"),
])
def test_it_shows_errors_of_ones_own_script_next_to_the_field(tmp_path, changes, field, message):
    c = operator_client()
    data = _form_data(PRESET_CHOICES["own-script"][2], working_dir=str(tmp_path), confirmed="yes")
    (tmp_path / "plain_fsdp.py").write_text("")
    data.update(entrypoint="plain_fsdp.py")
    data.update(changes)
    resp = c.post(reverse("dashboard:job_new"), data)
    assert resp.status_code == 400
    body = resp.content.decode()
    if field is None:  # the launcher's preflight: shown above the form
        assert message in body
    else:
        assert message in " ".join(resp.context["form"].errors[field]), resp.context["form"].errors
    assert not Job.objects.exists()


def test_the_own_script_preset_runs_the_example_that_ships_with_the_sdk():
    spec = PRESET_CHOICES["own-script"][2]
    assert spec.entrypoint == EXAMPLE_SCRIPT and spec.in_process is False
    c = operator_client()
    resp = c.post(reverse("dashboard:job_new"), _form_data(spec, confirmed="yes"))
    assert resp.status_code == 302
    assert Job.objects.get().job_spec == spec


def test_the_job_page_says_what_ran_its_level_and_what_that_level_cannot_show():
    c = operator_client()
    spec = JobSpec(entrypoint="src/train.py", args=("--lr", "3e-4"), working_dir="/srv/project",
                   env={"DATA": "/data"}, in_process=False).to_dict()
    job = make_job(spec=spec)
    page = c.get(reverse("dashboard:job", args=[job.pk])).content.decode()
    assert "src/train.py --lr 3e-4" in page and "/srv/project" in page and "env DATA" in page
    assert "waiting for the ranks to start" in page
    assert "no checkpoint ledger" in page and "preset tiny" not in page

    for rank in (0, 1):
        Event.objects.create(job=job, event_id=f"i{rank}", kind=EventKind.INTEGRATION, rank=rank, at=timezone.now(),
                             received_at=timezone.now(), data={"level": 0, "torch": "2.13.0", "nvrx": "0.4.1",
                                                               "sdk": "0.1.0", "python": "3.11.7"})
    page = c.get(reverse("dashboard:job", args=[job.pk])).content.decode()
    assert "level 0 · sdk 0.1.0 · torch 2.13.0 · nvrx 0.4.1" in page
    assert "No phases, no checkpoint ledger" in page

    Event.objects.create(job=job, event_id="i-up", kind=EventKind.INTEGRATION, rank=0, at=timezone.now(),
                         received_at=timezone.now(), data={"level": 1, "torch": "2.13.0", "nvrx": "0.4.1"})
    page = c.get(reverse("dashboard:job", args=[job.pk])).content.decode()
    assert "level 1" in page and "phases, commands and hang detection" in page


def test_the_fault_table_unfolds_a_long_message_such_as_a_traceback():
    c = operator_client()
    job = make_job()
    tb = "DrillError: boom\n\nTraceback (most recent call last):\n  File \"train.py\", line 3, in <module>\n"
    make_fault(job, at=timezone.now(), fault_class="exception", message=tb)
    page = c.get(reverse("dashboard:job", args=[job.pk])).content.decode()
    assert '<details class="evidence">' in page and "line 3, in &lt;module&gt;" in page


def test_a_level0_job_is_stopped_without_the_trainers_grace_and_the_confirmation_says_so():
    """An unmodified script cannot see a stop command: waiting for it to save would only delay the stop."""
    c = operator_client()
    job = make_job(spec=JobSpec(entrypoint="train.py", in_process=False).to_dict())
    assert services.stop_grace_s(job) == launcher_port.TRAINER_STOP_GRACE_S  # nothing reported yet

    def hello(level: int, rank: int) -> None:
        Event.objects.create(job=job, event_id=f"i{level}-{rank}", kind=EventKind.INTEGRATION, rank=rank,
                             at=timezone.now(), received_at=timezone.now(), data={"level": level})

    hello(0, 0)
    hello(0, 1)
    assert services.stop_grace_s(job) == 0.0
    page = c.post(reverse("dashboard:job_stop", args=[job.pk])).content.decode()
    assert "cannot save on a stop: its processes are terminated now" in page

    hello(1, 0)  # unbroken.init() ran: the loop sees stop_requested() and saves
    assert services.stop_grace_s(job) == launcher_port.TRAINER_STOP_GRACE_S
    page = c.post(reverse("dashboard:job_stop", args=[job.pk])).content.decode()
    assert "saves a final checkpoint" in page
