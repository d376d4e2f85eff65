"""The fault page and the API's fault: why a fault happened in one sentence, with its proof
(controlplane/jobs/evidence.py), the sentence's numbers from readouts.fault_figures."""

from __future__ import annotations

import base64
from datetime import datetime, timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from controlplane.jobs import evidence
from controlplane.jobs.models import Event

from .factories import PASSWORD, make_checkpoint, make_cycle, make_fault, make_job, make_rank, make_user

pytestmark = pytest.mark.django_db

TRACEBACK = """drill 12:exception:1 HF_TOKEN=hf_abcdefghijklmnopqrstuvwxyz

Traceback (most recent call last):
  File "/app/trainer/shim.py", line 120, in main
    run(fn)
  File "/app/train.py", line 42, in train_step
    loss = model(batch)
ValueError: shapes do not match (token=s3cr3t-value-123)"""


def _killed_during_a_save():
    now = timezone.now()
    job = make_job(now=now, age_s=300, spec={"procs_per_node": 4, "steps": 1000, "backend": "local"})
    make_rank(job, 3, now=now, node="node-2")
    at = now - timedelta(seconds=60)
    make_checkpoint(job, 400, started_at=at - timedelta(seconds=0.5), durable_s=3.0)
    cycle = make_cycle(job, "a0-ij1", layer="in_job", fault_at=at, marks=(0.4, 0.6, 1.0, 1.8, 2.1),
                       step_at_fault=410, resumed_from_step=400)
    Event.objects.create(job=job, event_id="launcher-f1", kind="fault", rank=3, at=at + timedelta(seconds=0.4),
                         data={"fault": "process_killed", "interruption": "exit -9 SIGKILL", "step": 410})
    fault = make_fault(job, at=at, rank=3, fault_class="process_killed", cycle=cycle, node="",
                       detected_by="launcher", message="rank 3: exit -9 (SIGKILL)", key="event:launcher-f1")
    return job, fault


def _viewer(client):
    make_user("viewer")
    assert client.login(username="viewer", password=PASSWORD)


def test_it_says_why_a_kill_happened_in_one_sentence(client):
    job, fault = _killed_during_a_save()
    ev = evidence.fault_evidence(fault, rank_nodes=job.rank_nodes())
    assert ev.summary == ("Rank 3 on node-2 was killed by SIGKILL during checkpoint save at step 410; "
                          "ft_launcher restarted the worker group in 2.1 s; 10 steps were recomputed.")
    assert (ev.signal, ev.exit_code, ev.phase, ev.step) == ("SIGKILL", -9, "checkpoint save", 410)
    _viewer(client)
    table = client.get(reverse("dashboard:job_part", args=[job.pk, "faults"])).content.decode()
    url = reverse("dashboard:fault", args=[job.pk, fault.pk])
    assert f'href="{url}"' in table
    page = client.get(url).content.decode()
    assert ev.summary in page and "signal SIGKILL" in page and "exit code -9" in page


def test_the_page_needs_a_login_and_the_api_serves_the_same_evidence(client):
    job, fault = _killed_during_a_save()
    url = reverse("dashboard:fault", args=[job.pk, fault.pk])
    assert client.get(url).status_code == 302  # to the login page
    make_user("viewer")
    auth = {"HTTP_AUTHORIZATION": "Basic " + base64.b64encode(f"viewer:{PASSWORD}".encode()).decode()}
    assert client.get(f"/api/v1/jobs/{job.pk}/faults/{fault.pk}").status_code == 401
    got = client.get(f"/api/v1/jobs/{job.pk}/faults/{fault.pk}", **auth).json()
    assert got["evidence"]["summary"].startswith("Rank 3 on node-2 was killed by SIGKILL")
    assert (got["fault"]["id"], got["evidence"]["signal"], got["evidence"]["step"]) == (fault.pk, "SIGKILL", 410)
    missing = client.get(f"/api/v1/jobs/{job.pk}/faults/{fault.pk + 1000}", **auth)
    assert missing.status_code == 404 and "no fault" in missing.json()["error"]


def test_an_exception_shows_its_type_message_and_last_frames_without_secrets(client):
    now = timezone.now()
    job = make_job(now=now)
    fault = make_fault(job, at=now - timedelta(seconds=5), rank=1, message=TRACEBACK)
    ev = evidence.fault_evidence(fault)
    assert (ev.exception_type, ev.exception_message) == ("ValueError", "shapes do not match (token=[redacted])")
    assert [(f.file, f.line, f.function, f.code) for f in ev.frames] == [
        ("/app/trainer/shim.py", 120, "main", "run(fn)"), ("/app/train.py", 42, "train_step", "loss = model(batch)")]
    assert ev.summary.startswith("Rank 1 on node-a raised ValueError (shapes do not match")
    assert "no restart layer handled it" in ev.summary
    _viewer(client)
    page = client.get(reverse("dashboard:fault", args=[job.pk, fault.pk])).content.decode()
    assert "hf_abcdefghijklmnopqrstuvwxyz" not in page and "s3cr3t-value-123" not in page
    assert "train_step" in page


def test_it_takes_the_rank_s_log_lines_around_the_fault():
    at = datetime(2026, 12, 3, 15, 0, 30).astimezone()  # log lines carry local time
    text = "\n".join([
        "2026-12-03 15:00:05,000 r1 INFO x: too early",
        "2026-12-03 15:00:25,000 r0 INFO x: another rank",
        "2026-12-03 15:00:25,500 r1 INFO x: saving step 410 password=hunter2",
        "2026-12-03 15:00:30,100 r1 ERROR x: boom",
        "Traceback (most recent call last):",
        '  File "t.py", line 1, in <module>',
        "2026-12-03 15:00:31,000 launcher INFO trainer.launch: worker group FAILED",
        "2026-12-03 15:00:40,000 r1 INFO x: too late",
    ])
    assert evidence.log_lines(text, rank=1, at=at) == [
        "2026-12-03 15:00:25,500 r1 INFO x: saving step 410 password=[redacted]",
        "2026-12-03 15:00:30,100 r1 ERROR x: boom",
        "Traceback (most recent call last):",
        '  File "t.py", line 1, in <module>',
        "2026-12-03 15:00:31,000 launcher INFO trainer.launch: worker group FAILED",
    ]


def test_it_shows_the_detection_recovery_and_steps_lost_the_table_shows(client):
    """The fault was sent 0.8 s after it happened (the fault row's detected_at), its cycle's layer
    detected it after 0.4 s: the page, like the table and the hovers, says 0.4 s."""
    job, fault = _killed_during_a_save()
    fault.detected_at = fault.at + timedelta(seconds=0.8)
    fault.save()
    _viewer(client)
    table = client.get(reverse("dashboard:job_part", args=[job.pk, "faults"])).content.decode()
    page = client.get(reverse("dashboard:fault", args=[job.pk, fault.pk])).content.decode()
    assert "400 ms" in table and "2.10 s" in table
    detected = page.split('data-testid="fault-detected">')[1].split("</td>")[0]
    assert "400 ms later" in detected and "800 ms" not in detected
    assert (fault.at + timedelta(seconds=0.4)).strftime("%H:%M:%S.%f") in detected
    assert 'data-testid="fault-recovery">2.10 s<' in page and 'data-testid="fault-lost">10<' in page


def test_a_finished_jobs_unrecovered_fault_is_not_in_progress(client):
    now = timezone.now()
    job = make_job(now=now, age_s=300, status="failed", finished_at=now - timedelta(seconds=30))
    cycle = make_cycle(job, "a0-ij1", layer="in_job", fault_at=now - timedelta(seconds=60), marks=(0.4, None))
    fault = make_fault(job, at=now - timedelta(seconds=60), rank=0, cycle=cycle)
    late = make_fault(job, at=now - timedelta(seconds=10), rank=1, fault_class="process_killed", key="late")
    _viewer(client)
    table = client.get(reverse("dashboard:job_part", args=[job.pk, "faults"])).content.decode()
    assert "in progress" not in table
    assert (now - timedelta(seconds=10)).strftime("%H:%M:%S") not in table  # folded into the end
    assert (now - timedelta(seconds=30)).strftime("%H:%M:%S") in table
    page = client.get(reverse("dashboard:fault", args=[job.pk, fault.pk])).content.decode()
    assert "is restarting" not in page and "in progress" not in page and "when the job ended" in page
    assert late.pk
