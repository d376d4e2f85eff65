"""controlplane.jobs.policy: every recorded fault is decided once, the decision is a timeline event with the
rule that fired, and a written rule's action is carried out (stop, stop and keep, restart the job, restart
in-job, notify). The job page's "what next" table comes from the same decision function."""

from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.jobs import policy, supervision
from controlplane.jobs.launcher_port import launcher_requested
from controlplane.jobs.models import Command, Event, Fault, Job, Notification, RestartCycle
from tests.controlplane.conftest import make_job
from trainer.policy_rules import parse_rules

pytestmark = pytest.mark.django_db


@pytest.fixture()
def nudges(monkeypatch):
    """What the control plane asks of the launcher (nobody carries it out here)."""
    got = []
    monkeypatch.setattr(launcher_requested, "receivers", [])
    launcher_requested.connect(lambda **kw: got.append((kw["action"], kw["job_id"])), weak=False)
    return got


def _job(rules, **kw):
    job, _ = make_job(spec={"failure_policy": parse_rules(rules), "procs_per_node": 2}, **kw)
    return job


def _fault(job, cls, *, at=None, rank=1, message="", key=None, cycle=None):
    at = at or timezone.now()
    return Fault.objects.create(job=job, fault_class=cls, rank=rank, detected_by="trainer", message=message,
                                at=at, detected_at=at, cycle=cycle, source_key=key or f"k{Fault.objects.count()}",
                                progress_at=Fault.progress_before(job.pk, at))  # as every recording site does


def _decisions(job):
    return [(e.data["subject"], e.data["action"], e.data["rule"])
            for e in Event.objects.filter(job=job, kind=policy.POLICY_EVENT).order_by("id")]


def test_it_stops_the_job_on_the_second_nan_loss_without_progress(nudges, django_capture_on_commit_callbacks):
    job = _job([{"match": {"class": "nan_loss"}, "action": "stop", "after": 2}], notify_email="ops@example.com",
               last_progress_at=timezone.now() - timedelta(seconds=30))
    _fault(job, "nan_loss")
    assert policy.apply_policies() == 0
    job.refresh_from_db()
    assert job.status == "running"
    assert _decisions(job) == [("nan_loss on rank 1", "retry_in_process", None)]

    _fault(job, "nan_loss")
    with django_capture_on_commit_callbacks(execute=True):
        assert policy.apply_policies() == 1
    job.refresh_from_db()
    assert job.status == "failed"
    assert job.status_reason.startswith("failure policy rule 1: nan_loss ×2 without progress → stop the job")
    assert _decisions(job)[-1] == ("nan_loss on rank 1", "stop", 1)
    stop = Command.objects.get(job=job, kind="stop")
    assert not stop.via_trainer and nudges == [("stop", job.pk)]
    assert Notification.objects.get(job=job).transition == "policy"
    assert policy.apply_policies() == 0  # decided once
    assert Fault.objects.filter(job=job, policy_at__isnull=True).count() == 0


def test_progress_between_two_faults_resets_the_count(nudges):
    now = timezone.now()
    job = _job([{"match": {"class": "nan_loss"}, "action": "stop", "after": 2}],
               last_progress_at=now - timedelta(seconds=5))
    _fault(job, "nan_loss", at=now - timedelta(seconds=10))  # before the last progress
    _fault(job, "nan_loss", at=now)
    assert policy.apply_policies() == 0
    job.refresh_from_db()
    assert job.status == "running"
    whole_job = _job([{"match": {"class": "nan_loss"}, "action": "stop", "after": 2, "without_progress": False}],
                     last_progress_at=now - timedelta(seconds=5))
    _fault(whole_job, "nan_loss", at=now - timedelta(seconds=10))
    _fault(whole_job, "nan_loss", at=now)
    assert policy.apply_policies() == 1
    whole_job.refresh_from_db()
    assert whole_job.status == "failed"


def test_progress_after_a_fault_does_not_take_it_out_of_its_own_count(nudges, django_capture_on_commit_callbacks):
    """The ranks resume within a second of an in-process restart: the step progress they make can reach
    the job before the watchdog's pass decides the fault. Decided late, it still counts (itself, and the
    faults since the progress before it)."""
    now = timezone.now()
    once = _job([{"match": {"class": "exception"}, "action": "stop_keep"}],
                last_progress_at=now - timedelta(seconds=30))
    _fault(once, "exception", at=now - timedelta(seconds=2))
    twice = _job([{"match": {"class": "nan_loss"}, "action": "stop", "after": 2}],
                 last_progress_at=now - timedelta(seconds=30))
    _fault(twice, "nan_loss", at=now - timedelta(seconds=20))
    _fault(twice, "nan_loss", at=now - timedelta(seconds=2))
    Job.objects.filter(pk__in=[once.pk, twice.pk]).update(last_progress_at=now - timedelta(seconds=1), max_step=13)
    with django_capture_on_commit_callbacks(execute=True):
        assert policy.apply_policies() == 2
    for job, words in ((once, "exception → stop, keep processes"), (twice, "nan_loss ×2 without progress → stop")):
        job.refresh_from_db()
        assert job.status == "failed", job.status_reason
        assert words in job.status_reason, job.status_reason


def test_it_reads_the_exit_code_of_the_trainers_fault_event(nudges):
    job = _job([{"match": {"exit_code": 93}, "action": "stop"}])
    at = timezone.now()
    for code in (1, 93):
        ev = Event.objects.create(job=job, event_id=f"e{code}", kind="fault", rank=0, at=at,
                                  data={"fault": "exception", "interruption": f"exit {code}"})
        _fault(job, "exception", key=f"event:{ev.event_id}", message="worker group FAILED")
    assert policy.apply_policies() == 1
    job.refresh_from_db()
    assert job.status == "failed" and "exit code 93" in job.status_reason
    assert [d[1:] for d in _decisions(job)] == [("retry_in_process", None), ("stop", 1)]


def test_stop_and_keep_fails_the_job_and_asks_the_launcher_to_hold_it(nudges, django_capture_on_commit_callbacks):
    job = _job([{"match": {"class": "exception"}, "action": "stop_keep"}])
    _fault(job, "exception")
    with django_capture_on_commit_callbacks(execute=True):
        assert policy.apply_policies() == 1
    job.refresh_from_db()
    assert job.status == "failed" and "kept for debugging" in job.status_reason
    assert nudges == [("hold", job.pk)]
    assert not Command.objects.filter(job=job, kind="stop").exists()


def test_restart_job_asks_the_launcher_once(nudges, django_capture_on_commit_callbacks):
    job = _job([{"match": {"class": "hang"}, "action": "restart_job"}])
    _fault(job, "hang")
    _fault(job, "hang", rank=0)
    with django_capture_on_commit_callbacks(execute=True):
        assert policy.apply_policies() == 1  # the second hang finds the restart on its way
    cmd = Command.objects.get(job=job, kind="restart")
    assert (cmd.level, cmd.via_trainer) == ("job", False) and cmd.detail.startswith("failure policy rule 1")
    assert nudges == [("restart", job.pk)]


def test_restart_in_job_is_a_command_to_the_trainer(nudges):
    job = _job([{"match": {"class": "nan_loss"}, "action": "restart_in_job"}])
    _fault(job, "nan_loss")
    assert policy.apply_policies() == 1
    cmd = Command.objects.get(job=job)
    assert (cmd.kind, cmd.level, cmd.via_trainer, cmd.status) == ("restart", "in_job", True, "pending")
    assert cmd.to_wire()["level"] == "in_job"


def test_notify_tells_the_channels_and_changes_nothing_else(nudges):
    job = _job([{"match": {"class": "heartbeat_lost"}, "action": "notify"}], notify_webhook_url="https://x.test/h")
    _fault(job, "heartbeat_lost", message="no heartbeat from rank 1 for 31.0 s")
    assert policy.apply_policies() == 1
    n = Notification.objects.get(job=job)
    assert n.transition == "policy" and "heartbeat_lost on rank 1" in n.payload["text"]
    job.refresh_from_db()
    assert job.status == "running" and not Command.objects.filter(job=job).exists()


def test_a_default_decision_names_the_layer_that_took_the_fault(nudges):
    job = _job([])
    cycle = RestartCycle.objects.create(job=job, key="a0-ij1", layer="in_job", fault_at=timezone.now())
    _fault(job, "process_killed", cycle=cycle)
    assert policy.apply_policies() == 0
    e = Event.objects.get(job=job, kind=policy.POLICY_EVENT)
    assert (e.data["action"], e.data["rule"]) == ("restart_in_job", None)
    assert e.data["why"] == "default: the in-job layer took it"


def test_the_watchdog_decides_faults_and_skips_finished_jobs(nudges):
    job = _job([{"match": {"class": "stalled"}, "action": "stop"}])
    done = _job([{"match": {"class": "stalled"}, "action": "stop"}], status="succeeded")
    _fault(job, "stalled")
    _fault(done, "stalled")
    assert supervision.run_watchdog().policies == 1
    assert Job.objects.get(pk=job.pk).status == "failed"
    assert not Event.objects.filter(job=done, kind=policy.POLICY_EVENT).exists()


def test_a_straggler_rule_acts_when_a_rank_is_marked(nudges):
    job = _job([{"match": {"class": "straggler"}, "action": "restart_in_job"}])
    now = timezone.now()
    Event.objects.create(job=job, event_id="s1", kind="straggler", rank=1, at=now, data={"state": "marked"})
    assert policy.apply_to_straggler(job, 1, 31.0, now)
    assert Command.objects.get(job=job).level == "in_job"
    assert _decisions(job) == [("straggler rank 1 (31 % slower)", "restart_in_job", 1)]
    assert not policy.apply_to_straggler(_job([]), 1, 31.0, now)


def test_what_next_says_what_the_next_fault_of_each_class_would_cause():
    job = _job([{"match": {"class": "nan_loss"}, "action": "stop", "after": 2},
                {"match": {"exit_code": 93}, "action": "stop"}],
               last_progress_at=timezone.now() - timedelta(seconds=30))
    rows = {r.label: r for r in policy.what_next(job)}
    assert rows["nan_loss"].action == "retry_in_process" and not rows["nan_loss"].written
    assert rows["exit code 93"].action == "stop" and rows["exit code 93"].written
    assert rows["process_killed"].action == "restart_in_job"
    assert rows["straggler"].action == "mark"
    assert "oom_killed" not in rows  # a local job has no pods
    _fault(job, "nan_loss")
    rows = {r.label: r for r in policy.what_next(job)}
    assert rows["nan_loss"].action == "stop" and rows["nan_loss"].why.startswith("rule 1:")


def test_what_next_counts_down_the_layers_budgets():
    job = _job([], attempt=3)
    for i in range(1, 6):
        RestartCycle.objects.create(job=job, key=f"a3-ij{i}", layer="in_job")
    for i in range(1, 11):
        RestartCycle.objects.create(job=job, key=f"a3-ij5-ip{i}", layer="in_process")
    rows = {r.label: r for r in policy.what_next(job)}
    # in-process (10) and in-job (5) used up in this attempt, job-level restarts (3) too: the job stops
    assert rows["exception"].action == "stop", rows["exception"]
    RestartCycle.objects.filter(job=job, key="a3-ij5-ip10").delete()
    assert rows["process_killed"].action == "stop"
    assert {r.label: r for r in policy.what_next(job)}["exception"].why == "default: in_process on, 1 left"
