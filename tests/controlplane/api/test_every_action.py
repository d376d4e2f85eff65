"""Stateful: press each action an operator has (a restart at each level, each injected fault, a stop), let
the trainer carry it out the way it does in production (it fetches the command with a heartbeat batch,
reports the cycle it caused with the command's id, acknowledges), and after every step read every read
the operator API has, each answer validated against the served OpenAPI document. The order of the
actions is drawn (hypothesis), since a cycle's shape depends on what came before it."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.api import openapi
from controlplane.ingest import views as ingest_views
from controlplane.jobs import services
from controlplane.jobs.models import Command, Job
from tests.controlplane.api.conformance import conforms
from tests.controlplane.conftest import batch, ev, hb, make_job
from trainer.wire import DrillFault

pytestmark = pytest.mark.django_db
DOC = "/api/v1/operator/openapi.json"
RESTARTS = ("in_process", "in_job", "job")
INJECTED = tuple(f.value for f in DrillFault)


class Trainer:
    """The trainer's side of a 2-rank job: heartbeats that fetch commands, and the events a command causes."""

    def __init__(self, post, job: Job, token: str):
        self.post, self.job, self.token = post, job, token
        self.t = time.time() - 300
        self.step, self.attempt, self.in_job, self.in_process, self.n = 0, 0, 0, 0, 0

    def beat(self, steps: int = 5, events: list | None = None) -> list[dict]:
        beats = []
        for _ in range(steps):
            self.step += 1
            self.t += 0.5
            beats += [hb(r, step=self.step, at=self.t, step_time_s=0.5, loss=2.0, tokens_per_s=900.0)
                      for r in (0, 1)]
        ingest_views.clear_caches()  # the commands' cache: a moment has passed
        r = self.post(self.job, self.token, batch(beats, events or []))
        assert r.status_code == 200, r.content
        return r.json()["commands"]

    def event(self, kind: str, data: dict, rank: int | None = None) -> dict:
        self.n += 1
        self.t += 0.2
        return ev(f"e{self.n}", kind, data, at=self.t, rank=rank)

    def cycle(self, key: str, layer: str, command_id: int | None, resumed: int) -> list[dict]:
        marks = ["fault_at", "detected_at", "aborted_at", "restarted_at", "checkpoint_loaded_at",
                 "first_step_at"]
        out = []
        for mark in marks:
            data = {"cycle": key, "mark": mark, "layer": layer}
            if mark == "fault_at":
                data["step"] = self.step
                if command_id is not None:
                    data["command_id"] = command_id
            if mark == "checkpoint_loaded_at":
                data["step"] = resumed
            out.append(self.event("cycle", data))
        return out

    def carry_out(self, cmd: dict) -> None:
        """What the trainer does with a command it fetched: the restart or fault it causes, then its ack."""
        resumed = max(0, self.step - 3)
        events = []
        if cmd["kind"] == "restart" and cmd["level"] == "in_process":
            self.in_process += 1
            key = f"a{self.attempt}-ij{self.in_job}-ip{self.in_process}"
            events = self.cycle(key, "in_process", cmd["id"], resumed)
        elif cmd["kind"] == "restart":
            self.in_job += 1
            self.in_process = 0
            events = self.cycle(f"a{self.attempt}-ij{self.in_job}", "in_job", cmd["id"], resumed)
        elif cmd["kind"] == "inject_fault":
            self.in_process += 1
            key = f"a{self.attempt}-ij{self.in_job}-ip{self.in_process}"
            events = [self.event("fault", {"fault": "exception", "cycle": key, "detected_by": "in_process",
                                           "message": f"injected {cmd['fault']} (command {cmd['id']})",
                                           "step": self.step}, rank=cmd["rank"]),
                      *self.cycle(key, "in_process", None, resumed)]
        events.append(self.event("command_ack", {"command_id": cmd["id"], "ok": True, "detail": "done"}))
        self.step = resumed
        self.beat(3, events)

    def relaunch(self, cmd_id: int) -> None:
        """A job-level restart as the launcher carries it out (``restart_job_now`` less the processes):
        the cycle opened, attempt N+1 claimed, then the new processes report their reload and first step."""
        job = Job.objects.get(pk=self.job.pk)
        services.begin_job_restart(job=job, reason=f"restart command {cmd_id} (job)")
        self.attempt += 1
        self.in_job = self.in_process = 0
        Job.objects.filter(pk=job.pk).update(attempt=self.attempt)
        resumed = max(0, self.step - 3)
        key = f"job{self.attempt}"
        events = [self.event("cycle", {"cycle": key, "mark": "restarted_at", "layer": "job"}),
                  self.event("cycle", {"cycle": key, "mark": "checkpoint_loaded_at", "layer": "job",
                                       "step": resumed}),
                  self.event("cycle", {"cycle": key, "mark": "first_step_at", "layer": "job"})]
        self.step = resumed
        self.beat(3, events)
        services.finish_command(command_id=cmd_id, detail=f"relaunched as attempt {self.attempt}")


ACTIONS = [("restart", level) for level in RESTARTS] + [("inject", fault) for fault in INJECTED]


@settings(max_examples=4, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(order=st.permutations(ACTIONS))
def test_it_answers_every_read_as_documented_after_every_action(client, post, order):
    operator = User.objects.get_or_create(username="op", defaults={"is_superuser": True})[0]
    client.force_login(operator)
    doc = client.get(DOC).json()
    job, token = make_job(spec={"procs_per_node": 2, "steps": 10_000}, name="every-action")
    trainer = Trainer(post, job, token)
    trainer.beat(10)
    for action, what in order:
        job = Job.objects.get(pk=job.pk)
        if action == "restart":
            cmd = services.restart_job(job=job, level=what, requested_by=operator)
        else:
            cmd = services.inject_fault(job=job, fault=what, rank=1, requested_by=operator)
        _read_everything(client, doc, job)  # issued, not yet fetched
        if what == "job":
            trainer.relaunch(cmd.pk)
        else:
            fetched = trainer.beat(1)
            assert [c["id"] for c in fetched] == [cmd.pk]
            _read_everything(client, doc, job)  # fetched, not yet carried out
            trainer.carry_out(fetched[0])
        _read_everything(client, doc, job)
    services.stop_job(job=Job.objects.get(pk=job.pk), requested_by=operator)
    (stop,) = trainer.beat(1)
    trainer.beat(1, [trainer.event("command_ack", {"command_id": stop["id"], "ok": True, "detail": "saved"})])
    services.set_status(Job.objects.get(pk=job.pk), "stopped", "stopped by an operator")
    cycles = _read_everything(client, doc, job)["cycles"]["cycles"]
    operators = [c for c in cycles if c["marks"]["delivered_at"] is not None]
    assert len(operators) == 2 and all(c["durations"]["deliver"] is not None for c in operators)
    assert {c["layer"] for c in cycles} == {"in_process", "in_job", "job"}


def _read_everything(client, doc, job) -> dict:
    """Every GET the document declares, for this job (and each of its faults)."""
    out = {}
    faults = list(job.faults.values_list("id", flat=True))
    for route in openapi.ROUTES:
        if route.method != "get":
            continue
        urls = [route.path.replace("{job_id}", str(job.pk))]
        if "{fault_id}" in route.path:
            urls = [urls[0].replace("{fault_id}", str(f)) for f in faults]
        for url in urls:
            r = client.get(url)
            assert r.status_code == 200, (url, r.content[:2000])
            conforms(doc, "get", url, r)
            out[route.path.rsplit("/", 1)[-1]] = r.json()
    return out


def test_an_operators_restart_has_a_row_and_a_hoverable_breakdown(client, post):
    from django.urls import reverse
    from django.utils import timezone

    from controlplane.dashboard.parts import timeline_part

    operator = User.objects.create_user("op", is_superuser=True)
    job, token = make_job(spec={"procs_per_node": 2, "steps": 10_000}, name="operator-restart",
                          started_at=timezone.now() - timedelta(seconds=310))
    trainer = Trainer(post, job, token)
    trainer.beat(10)
    cmd = services.restart_job(job=Job.objects.get(pk=job.pk), level="in_process", requested_by=operator)
    (fetched,) = trainer.beat(1)
    trainer.carry_out(fetched)
    job = Job.objects.get(pk=job.pk)
    fig = timeline_part.timeline_part(job, timezone.now())["figure"]
    commands = [t for t in fig["data"] if t["name"] == "operator command"]
    assert commands == []  # the restart's own marker stands for it: nothing on top of it takes its hover
    (restart,) = [t for t in fig["data"] if t["name"].startswith("restart ·")]
    (hover,) = restart["customdata"]
    assert f"asked for by op: restart (in-process) ({Command.objects.get(pk=cmd.pk).status})" in hover
    assert "deliver " in hover and "first step " in hover
    client.force_login(operator)
    table = client.get(reverse("dashboard:job_part", args=[job.pk, "faults"])).content.decode()
    row = table.split('data-testid="restart-action"')[1].split("</tr>")[0]
    assert "restart (in-process) asked for by op" in row and "action" in row and 'title="deliver ' in row
