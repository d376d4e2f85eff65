"""The operator API's reads: a job and its ranks, faults, cycles, checkpoints, goodput and commands, from
a job built through the real ingest endpoint; pagination, filters, auth and errors. Every response is
validated against the served OpenAPI document (``conforms``)."""

from __future__ import annotations

import pytest

from tests.controlplane.api import drill
from tests.controlplane.api.conformance import conforms
from tests.controlplane.api.logins import DOC, basic

pytestmark = pytest.mark.django_db


@pytest.fixture()
def job(post, settle, operator):
    return drill.build(post, settle, user=operator)


def test_it_shows_the_job_with_a_summary_and_links(api, job):
    j = api(f"/api/v1/jobs/{job.pk}")
    assert (j["id"], j["status"], j["steps"], j["last_step"]) == (job.pk, "succeeded", 300, 120)
    s = j["summary"]
    assert s["restarts"] == {"in_process": 1, "in_job": 1, "job": 0}
    assert s["faults"] == 2
    assert s["checkpoints"] == {"in_flight": 0, "durable": 3, "failed": 0, "abandoned": 1}
    assert s["ranks"] == {"stopped": 2}
    assert s["commands"] == {"pending": 1}
    assert s["quarantined"] == 0
    g = s["goodput"]
    assert sum(g["shares"].values()) == pytest.approx(1.0)
    assert sum(g["seconds"].values()) == pytest.approx(g["wall_s"])
    assert g["goodput"] == g["shares"]["productive"] > 0
    assert g["seconds"]["checkpoint_interference"] == pytest.approx(0.3, abs=1e-3)  # the save at step 20
    assert j["links"]["faults"] == f"/api/v1/jobs/{job.pk}/faults"
    assert j["integration"] is None  # the built-in model
    assert api(j["links"]["goodput"]) == g


def test_it_lists_faults_with_their_evidence(api, job):
    faults = api(f"/api/v1/jobs/{job.pk}/faults")["faults"]
    assert [f["fault_class"] for f in faults] == ["exception", "process_killed"]  # the order recorded
    exc, kill = faults
    assert (exc["rank"], exc["node"], exc["layer"], exc["cycle"], exc["detected_by"]) == (
        1, "node-a", "in_process", "a0-ij0-ip1", "in_process")
    assert exc["message"].startswith("RuntimeError: drill at step 60")
    assert exc["traceback"] == drill.TRACEBACK
    assert exc["detection_s"] == pytest.approx(0.2, abs=1e-3)
    assert exc["recovery_s"] == pytest.approx(1.5, abs=1e-3)
    assert exc["lost_steps"] == 20 and exc["recovering"] is False
    assert (kill["layer"], kill["traceback"], kill["lost_steps"]) == ("in_job", None, 10)
    assert kill["detection_s"] == pytest.approx(1.0, abs=1e-3)


def test_it_lists_cycles_with_their_marks_and_durations(api, job):
    cycles = api(f"/api/v1/jobs/{job.pk}/cycles")["cycles"]
    assert [c["layer"] for c in cycles] == ["in_process", "in_job"]
    ip = cycles[0]
    assert ip["key"] == "a0-ij0-ip1" and ip["reason"].startswith("exception: RuntimeError")
    assert all(ip["marks"][m] for m in ("fault_at", "detected_at", "aborted_at", "restarted_at",
                                        "checkpoint_loaded_at", "first_step_at"))
    assert ip["marks"]["delivered_at"] is None and ip["durations"].pop("deliver") is None  # no command
    assert ip["durations"] == pytest.approx({"detect": 0.2, "abort": 0.2, "restart": 0.2, "reload": 0.4,
                                             "first_step": 0.5}, abs=1e-3)
    assert (ip["step_at_fault"], ip["resumed_from_step"], ip["lost_steps"]) == (60, 40, 20)
    assert ip["recovery_s"] == pytest.approx(1.5, abs=1e-3)
    ij = cycles[1]
    assert ij["marks"]["aborted_at"] is None and ij["durations"]["abort"] is None
    assert ij["recovery_s"] == pytest.approx(5.0, abs=1e-3)


def test_it_lists_the_checkpoint_ledger(api, job):
    ck = api(f"/api/v1/jobs/{job.pk}/checkpoints")["checkpoints"]
    assert [(c["step"], c["state"]) for c in ck] == [(20, "durable"), (40, "durable"), (60, "abandoned"),
                                                     (80, "durable")]
    first = ck[0]
    assert (first["blocking_s"], first["bytes"], first["write_s"]) == (0.05, 30_000_000, 1.5)
    assert first["interference_s"] == 0.3 and ck[1]["interference_s"] is None  # the trainer's measure
    assert first["durable_s"] == pytest.approx(2.0, abs=1e-3)  # from the in_flight report
    assert first["mb_per_s"] == pytest.approx(20.0)
    assert ck[2]["durable_s"] is None and ck[2]["elapsed_s"] == pytest.approx(0.5, abs=1e-3)


def test_it_lists_ranks_and_commands(api, job, operator):
    ranks = api(f"/api/v1/jobs/{job.pk}/ranks")["ranks"]
    assert [(r["rank"], r["health"], r["step"], r["phase"]) for r in ranks] == [
        (0, "stopped", 120, "train"), (1, "stopped", 120, "train")]
    assert ranks[0]["heartbeat_at"] and ranks[0]["step_time_s"] == 0.5
    cmds = api(f"/api/v1/jobs/{job.pk}/commands")["commands"]
    assert [(c["kind"], c["level"], c["status"], c["issued_by"]) for c in cmds] == [
        ("restart", "in_process", "pending", "op")]


def test_it_shows_a_running_jobs_ranks_with_their_health_and_unreported_ones(api, post, settle, operator):
    job = drill.build(post, settle, user=operator, finish=False)
    from controlplane.jobs.models import Job

    Job.objects.filter(pk=job.pk).update(spec={**job.spec, "procs_per_node": 3})  # rank 2 never reported
    ranks = api(f"/api/v1/jobs/{job.pk}/ranks")["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2]
    assert ranks[2]["health"] == "unknown" and ranks[2]["heartbeat_at"] is None
    assert {r["health"] for r in ranks[:2]} <= {"ok", "late", "lost", "stalled"}
    only = api(f"/api/v1/jobs/{job.pk}/ranks", health="unknown")["ranks"]
    assert [r["rank"] for r in only] == [2]
    assert api(f"/api/v1/jobs/{job.pk}")["summary"]["ranks"]["unknown"] == 1


def test_it_pages_through_every_list_in_a_stable_order(api, job):
    for name, key in (("faults", "id"), ("cycles", "id"), ("checkpoints", "id"), ("ranks", "rank"),
                      ("samples", "id")):
        whole = api(f"/api/v1/jobs/{job.pk}/{name}")
        assert whole["next"] is None
        seen, url, pages = [], f"/api/v1/jobs/{job.pk}/{name}?limit=1", 0
        while url:
            page = api(url)
            assert len(page[name]) <= 1
            seen += page[name]
            url, pages = page["next"], pages + 1
        timeless = [{k: v for k, v in x.items() if k != "heartbeat_age_s"} for x in seen]
        assert timeless == [{k: v for k, v in x.items() if k != "heartbeat_age_s"} for x in whole[name]], name
        assert pages >= len(whole[name])
        assert [x[key] for x in seen] == sorted(x[key] for x in seen)


def test_it_keeps_filters_in_the_next_link(api, job):
    page = api(f"/api/v1/jobs/{job.pk}/checkpoints", state="durable", limit=2)
    assert [c["step"] for c in page["checkpoints"]] == [20, 40]
    assert "state=durable" in page["next"] and "limit=2" in page["next"]
    rest = api(page["next"])
    assert [c["step"] for c in rest["checkpoints"]] == [80] and rest["next"] is None


@pytest.mark.parametrize(("name", "params", "expect"), [
    ("faults", {"fault_class": "process_killed"}, ["process_killed"]),
    ("faults", {"layer": "in_process"}, ["exception"]),
    ("faults", {"rank": 1}, ["exception"]),
    ("faults", {"layer": "job"}, []),
    ("cycles", {"layer": "in_job"}, ["in_job"]),
    ("cycles", {"open": "false"}, ["in_process", "in_job"]),
    ("cycles", {"open": "true"}, []),
    ("checkpoints", {"state": "abandoned"}, [60]),
    ("commands", {"status": "done"}, []),
    ("commands", {"kind": "restart"}, ["restart"]),
])
def test_it_filters_the_lists(api, job, name, params, expect):
    field = {"faults": "fault_class", "cycles": "layer", "checkpoints": "step", "commands": "kind"}[name]
    assert [x[field] for x in api(f"/api/v1/jobs/{job.pk}/{name}", **params)[name]] == expect


@pytest.mark.parametrize(("url", "params", "field"), [
    ("faults", {"fault_class": "meteor"}, "fault_class"),
    ("faults", {"rank": "-1"}, "rank"),
    ("faults", {"limit": "0"}, "limit"),
    ("faults", {"limit": "501"}, "limit"),
    ("cycles", {"open": "maybe"}, "open"),
    ("ranks", {"health": "great"}, "health"),
    ("checkpoints", {"page": "2"}, "page"),
    ("", {"verbose": "1"}, "verbose"),
])
def test_it_refuses_a_bad_query_naming_the_parameter(api, job, url, params, field):
    body = api(f"/api/v1/jobs/{job.pk}/{url}".rstrip("/"), want=422, **params)
    assert body["field"] == field and body["error"]


def test_it_answers_an_unknown_job_with_404_json(api):
    for tail in ("", "/faults", "/cycles", "/checkpoints", "/ranks", "/commands", "/goodput", "/samples",
                 "/audit", "/quarantined", "/log"):
        assert api(f"/api/v1/jobs/999999{tail}", want=404) == {"error": "no job 999999"}


def test_it_answers_another_method_with_405_json(client, viewer, job):
    client.force_login(viewer)
    r = client.delete(f"/api/v1/jobs/{job.pk}/faults")
    assert r.status_code == 405 and r["Allow"] == "GET" and r.json()["error"]


def test_it_refuses_anonymous_readers_everywhere(client, job):
    doc = client.get(DOC).json()
    for path, ops in doc["paths"].items():
        url = path.replace("{job_id}", str(job.pk)).replace("{fault_id}", "1")
        for method in ops:
            r = getattr(client, method)(url, content_type="application/json")
            assert r.status_code == 401, (method, url)
            assert r["WWW-Authenticate"].startswith("Basic")
            conforms(doc, method, url, r)


def test_it_lets_a_viewer_read_over_basic_but_not_act(client, viewer, job):
    doc = client.get(DOC).json()
    r = client.get(f"/api/v1/jobs/{job.pk}/faults", **basic("viewer"))
    assert r.status_code == 200 and len(r.json()["faults"]) == 2
    url = f"/api/v1/jobs/{job.pk}/commands"
    r = client.post(url, {"kind": "stop"}, content_type="application/json", **basic("viewer"))
    assert r.status_code == 403 and "operators" in r.json()["error"]
    conforms(doc, "post", url, r)


def test_it_lists_jobs_newest_first_with_a_status_filter(api, post, settle, operator):
    done = drill.build(post, settle, user=operator)
    running = drill.build(post, settle, user=operator, finish=False)
    assert [j["id"] for j in api("/api/v1/jobs")["jobs"]] == [running.pk, done.pk]
    assert [j["id"] for j in api("/api/v1/jobs", status="succeeded")["jobs"]] == [done.pk]
    first = api("/api/v1/jobs", limit=1)
    assert [j["id"] for j in first["jobs"]] == [running.pk]
    assert [j["id"] for j in api(first["next"])["jobs"]] == [done.pk]


def test_it_lists_the_training_history_and_the_audit_log(api, job):
    samples = api(f"/api/v1/jobs/{job.pk}/samples")["samples"]
    assert samples and all(s["loss"] is not None and s["step"] > 0 for s in samples)
    assert api(f"/api/v1/jobs/{job.pk}/samples", rank=7)["samples"] == []
    audit = api(f"/api/v1/jobs/{job.pk}/audit")["audit"]
    assert [(a["action"], a["actor"]) for a in audit] == [("job.restart", "op")]
    assert audit[0]["detail"]["level"] == "in_process"


def test_it_shows_what_a_users_own_code_reported(api, client, post):
    from tests.controlplane.conftest import batch, ev, make_job

    job, token = make_job(spec={"procs_per_node": 2, "entrypoint": "train.py"})
    before = api(f"/api/v1/jobs/{job.pk}")["integration"]
    assert before == {"entrypoint": "train.py", "level": None, "versions": {}}
    hello = {"level": 1, "entrypoint": "train.py", "sdk": "0.1.0", "torch": "2.13.0", "nvrx": "0.4.1"}
    assert post(job, token, batch([], [ev("i0", "integration", hello, rank=0)])).status_code == 200
    shown = api(f"/api/v1/jobs/{job.pk}")["integration"]
    assert shown == {"entrypoint": "train.py", "level": 1,
                     "versions": {"sdk": "0.1.0", "torch": "2.13.0", "nvrx": "0.4.1"}}
    page = client.get(f"/jobs/{job.pk}/").context["code"]
    assert (page["level"], page["versions"]) == (shown["level"], shown["versions"])


def test_it_lists_quarantined_heartbeat_state(api, job):
    from django.utils import timezone

    from controlplane.jobs.heartbeats import record_quarantine

    record_quarantine(job.pk, 1, "step: must be an integer", b'{"step": "x\x00"}', now=timezone.now())
    record_quarantine(job.pk, 1, "step: must be an integer", b'{"step": "y"}', now=timezone.now())
    (q,) = api(f"/api/v1/jobs/{job.pk}/quarantined")["quarantined"]
    assert (q["rank"], q["reason"], q["count"]) == (1, "step: must be an integer", 2)
    assert q["payload"] == '{"step": "y"}'
    assert api(f"/api/v1/jobs/{job.pk}")["summary"]["quarantined"] == 1


def test_it_shows_the_end_of_the_log_or_why_there_is_none(api, client, tmp_path):
    from tests.controlplane.conftest import make_job

    log = tmp_path / "job.log"
    log.write_text("step 1 loss 7.0\nstep 2 loss 6.5\n")
    job, _ = make_job(launcher_state={"log": str(log)})
    assert api(f"/api/v1/jobs/{job.pk}/log") == {"text": "step 1 loss 7.0\nstep 2 loss 6.5\n", "why": None}
    empty, _ = make_job()
    shown = api(f"/api/v1/jobs/{empty.pk}/log")
    assert shown["text"] is None and "no log yet" in shown["why"]
    assert shown["why"] in client.get(f"/jobs/{empty.pk}/part/log/").content.decode()


def test_it_says_what_each_attempt_ran_with_from_the_launchers_start_events(api, post):
    from tests.controlplane.conftest import batch, ev, make_job

    job, token = make_job(spec={"procs_per_node": 2, "steps": 300})
    assert api(f"/api/v1/jobs/{job.pk}")["ran_with"] == []
    start = {"message": "starting ft_launcher", "torch": "2.13.0", "python": "3.11.2"}
    events = [ev("l0", "launcher", {**start, "attempt": 0, "nvrx": "0.4.1"}),
              ev("l1", "launcher", {**start, "attempt": 1, "nvrx": "0.6.0"})]
    assert post(job, token, batch([], events)).status_code == 200
    assert api(f"/api/v1/jobs/{job.pk}")["ran_with"] == [
        {"attempt": 1, "nvrx": "0.6.0", "torch": "2.13.0", "python": "3.11.2"},
        {"attempt": 0, "nvrx": "0.4.1", "torch": "2.13.0", "python": "3.11.2"}]
