"""POST /api/v1/jobs/<id>/ingest through Django (the same ``handle`` as the ASGI fast path)."""

import time

import orjson
import pytest

from controlplane.jobs.models import Command, CommandStatus, Event, Fault, Job, Rank, RestartCycle
from tests.controlplane.conftest import batch, ev, hb, make_job

pytestmark = pytest.mark.django_db


def nothing_written(job):
    return not Event.objects.filter(job=job).exists() and not Rank.objects.filter(job=job).exists()


def test_it_accepts_a_batch_and_answers_with_counts(post, settle):
    job, token = make_job()
    r = post(job, token, batch([hb(0, 3), hb(1, 3)], [ev("e1", "rank_started", {"world_size": 4})]))
    assert r.status_code == 200
    body = r.json()
    assert body["accepted"] == {"heartbeats": 2, "events": 1, "duplicates": 0}
    assert body["commands"] == [] and body["job_status"] == "running"
    settle()
    assert sorted(Rank.objects.filter(job=job).values_list("rank", "last_step")) == [(0, 3), (1, 3)]


def test_it_refuses_a_missing_token(post):
    job, _ = make_job()
    r = post(job, None, batch([hb(0)]))
    assert r.status_code == 401
    assert r["WWW-Authenticate"].startswith("Bearer")
    assert r.json()["field"] is None and "Bearer" in r.json()["error"]


def test_it_refuses_a_bad_token(post):
    job, _ = make_job()
    r = post(job, "ubk_wrong", batch([hb(0)]))
    assert r.status_code == 401
    assert nothing_written(job)


def test_it_refuses_another_jobs_token(post):
    job, _ = make_job()
    _, other_token = make_job(name="other")
    r = post(job, other_token, batch([hb(0)]))
    assert r.status_code == 401
    assert nothing_written(job)


def test_it_does_not_reveal_whether_a_job_exists(post):
    job, token = make_job()
    missing = post(job.pk + 1000, token, batch([hb(0)]))
    wrong = post(job, "ubk_wrong", batch([hb(0)]))
    assert missing.status_code == wrong.status_code == 401
    assert missing.json() == wrong.json()


def test_it_refuses_malformed_json(post):
    job, token = make_job()
    r = post(job, token, b'{"v": 1, "heartbeats": [')
    assert r.status_code == 400
    assert "JSON" in r.json()["error"]


@pytest.mark.parametrize("bad, field", [
    ({"heartbeats": [{**hb(0), "step": "7"}]}, "heartbeats[0].step"),
    ({"heartbeats": [{**hb(0), "rank": True}]}, "heartbeats[0].rank"),
    ({"heartbeats": [hb(0, phase="dancing")]}, "heartbeats[0].phase"),
    ({"heartbeats": [hb(0), hb(1, loss="low")]}, "heartbeats[1].loss"),
    ({"heartbeats": "many"}, "heartbeats"),
    ({"sent_at": "now"}, "sent_at"),
    ({"events": [ev("e1", "nonsense")]}, "events[0].kind"),
    ({"events": [ev("e1", "cycle", {"cycle": "a0-ij1", "mark": "lunch_at"})]}, "events[0].data.mark"),
    ({"events": [ev("e1", "fault", {"fault": "gremlins"})]}, "events[0].data.fault"),
    ({"events": [ev("e1", "checkpoint", {"step": "10", "state": "durable"})]}, "events[0].data.step"),
    ({"events": [ev("e1", "command_ack", {"command_id": 1, "ok": "yes"})]}, "events[0].data.ok"),
])
def test_it_refuses_wrong_types_naming_the_field(post, bad, field):
    job, token = make_job()
    r = post(job, token, batch(**{"heartbeats_": bad.pop("heartbeats", [hb(0)])}, **bad))
    assert r.status_code == 422, r.content
    assert r.json()["field"] == field
    assert nothing_written(job)


def test_it_refuses_an_unknown_rank(post):
    job, token = make_job()  # world size 4
    r = post(job, token, batch([hb(0), hb(1), hb(2), hb(4)]))
    assert r.status_code == 422
    assert r.json() == {"error": "unknown rank 4: this job has ranks 0..3", "field": "heartbeats[3].rank"}
    assert nothing_written(job)


def test_it_refuses_an_oversized_body(post, settings):
    settings.INGEST_MAX_BODY_BYTES = 2000
    job, token = make_job()
    r = post(job, token, batch([hb(i % 4, node="x" * 200) for i in range(20)]))
    assert r.status_code == 413
    assert "2000 bytes" in r.json()["error"]
    assert nothing_written(job)


def test_it_refuses_an_oversized_body_by_content_length(post, settings):
    settings.INGEST_MAX_BODY_BYTES = 2000
    job, token = make_job()
    r = post(job, token, batch([hb(0)]), CONTENT_LENGTH="5000000")
    assert r.status_code == 413


def test_it_refuses_clock_skew(post):
    job, token = make_job()
    now = time.time()
    r = post(job, token, batch([hb(0, at=now - 600)], sent_at=now - 600))
    assert r.status_code == 422
    assert r.json()["field"] == "sent_at" and "NTP" in r.json()["error"]


def test_it_refuses_timestamps_ahead_of_sent_at(post):
    job, token = make_job()
    now = time.time()
    r = post(job, token, batch([hb(0, at=now + 60)], sent_at=now))
    assert r.status_code == 422
    assert r.json()["field"] == "heartbeats[0].at"


def test_it_writes_nothing_when_any_part_is_bad(post):
    job, token = make_job()
    r = post(job, token, batch([hb(0), hb(1)], [ev("good", "rank_started"), ev("bad", "checkpoint", {"step": 1})]))
    assert r.status_code == 422
    assert r.json()["field"] == "events[1].data.state"
    assert nothing_written(job)


def test_it_stores_a_duplicate_batch_once(post, settle):
    job, token = make_job()
    now = time.time()
    body = batch([hb(0, 5, at=now)], [ev("f1", "fault", {"fault": "exception", "cycle": "a0-ij0-ip1"}, at=now),
                                      ev("c1", "cycle", {"cycle": "a0-ij0-ip1", "mark": "fault_at"}, at=now - 1)])
    first = post(job, token, body).json()
    second = post(job, token, body).json()
    assert first["accepted"] == {"heartbeats": 1, "events": 2, "duplicates": 0}
    assert second["accepted"] == {"heartbeats": 1, "events": 0, "duplicates": 2}
    assert Event.objects.filter(job=job).count() == 2
    assert Fault.objects.filter(job=job).count() == 1
    assert RestartCycle.objects.filter(job=job).count() == 1


def test_it_places_out_of_order_events_by_their_own_time(post):
    job, token = make_job()
    t = time.time()
    late = ev("c2", "cycle", {"cycle": "a0-ij1", "mark": "detected_at", "layer": "in_job"}, at=t - 10, rank=1)
    early = ev("c1", "cycle", {"cycle": "a0-ij1", "mark": "detected_at", "layer": "in_job"}, at=t - 12, rank=0)
    assert post(job, token, batch(events=[late])).status_code == 200
    assert post(job, token, batch(events=[early])).status_code == 200
    assert post(job, token, batch(events=[ev("c3", "cycle", {"cycle": "a0-ij1", "mark": "detected_at"},
                                             at=t - 5)])).status_code == 200
    cycle = RestartCycle.objects.get(job=job, key="a0-ij1")
    assert cycle.detected_at.timestamp() == pytest.approx(t - 12)


def test_it_never_lets_an_older_heartbeat_overwrite_a_newer_one(post, settle):
    job, token = make_job()
    t = time.time()
    assert post(job, token, batch([hb(0, 20, at=t)])).status_code == 200
    assert post(job, token, batch([hb(0, 10, at=t - 30)])).status_code == 200  # a spooled replay
    settle()
    rank = Rank.objects.get(job=job, rank=0)
    assert rank.last_step == 20 and rank.last_heartbeat_at.timestamp() == pytest.approx(t, abs=1e-3)


def test_it_takes_the_newest_of_one_ranks_beats_in_one_batch(post, settle):
    job, token = make_job()
    t = time.time()
    assert post(job, token, batch([hb(0, 9, at=t), hb(0, 7, at=t - 2), hb(0, 8, at=t - 1)])).status_code == 200
    settle()
    assert Rank.objects.get(job=job, rank=0).last_step == 9


def test_it_moves_a_launching_job_to_running_on_the_first_train_heartbeat(post):
    job, token = make_job(status="launching")
    assert post(job, token, batch([hb(0, 0, phase="init")])).status_code == 200
    assert Job.objects.get(pk=job.pk).status == "launching"
    assert post(job, token, batch([hb(0, 1, phase="train")])).json()["job_status"] == "running"
    assert Job.objects.get(pk=job.pk).status == "running"


def test_it_delivers_pending_commands_until_acknowledged(post):
    from controlplane.ingest import views

    job, token = make_job()
    cmd = Command.objects.create(job=job, kind="inject_fault", fault="exception", rank=1)
    Command.objects.create(job=job, kind="restart", level="job", via_trainer=False)  # the launcher's
    r = post(job, token, batch([hb(0)])).json()
    assert [c["id"] for c in r["commands"]] == [cmd.pk]
    assert r["commands"][0] == {"id": cmd.pk, "kind": "inject_fault", "level": None, "fault": "exception",
                                "rank": 1, "issued_at": pytest.approx(cmd.issued_at.timestamp())}
    cmd.refresh_from_db()
    assert cmd.status == CommandStatus.DELIVERED and cmd.delivered_at is not None
    views.clear_caches()
    assert [c["id"] for c in post(job, token, batch([hb(0)])).json()["commands"]] == [cmd.pk]  # re-sent
    views.clear_caches()
    ack = ev("ack1", "command_ack", {"command_id": cmd.pk, "ok": True, "detail": "raised"}, rank=1)
    assert post(job, token, batch(events=[ack])).json()["commands"] == []
    cmd.refresh_from_db()
    assert cmd.status == CommandStatus.ACKED and cmd.acked_at is not None and cmd.detail == "raised"


def test_it_accepts_late_facts_for_a_finished_job_without_commands(post):
    job, token = make_job(status="succeeded")
    Command.objects.create(job=job, kind="stop")
    r = post(job, token, batch([hb(0, phase="stopped")], [ev("fin0", "rank_finished", {"step": 300}, rank=0)]))
    assert r.status_code == 200
    assert r.json()["commands"] == [] and r.json()["job_status"] == "succeeded"
    assert Event.objects.filter(job=job, kind="rank_finished").count() == 1
    assert Job.objects.get(pk=job.pk).status == "succeeded"


def test_it_answers_get_with_405(client):
    job, token = make_job()
    r = client.get(f"/api/v1/jobs/{job.pk}/ingest", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert r.status_code == 405 and r["Allow"] == "POST"


def test_it_answers_in_the_documented_error_schema(post, client):
    import jsonschema

    schema = client.get("/api/v1/openapi.json").json()
    error_schema = schema["components"]["schemas"]["Error"]
    job, token = make_job()
    for r in (post(job, None, batch()), post(job, token, b"{"), post(job, token, batch([hb(9)]))):
        jsonschema.validate(orjson.loads(r.content), error_schema)
        assert str(r.status_code) in schema["paths"]["/api/v1/jobs/{job_id}/ingest"]["post"]["responses"]


def test_it_accepts_a_token_minted_after_the_job_was_cached(post):
    from controlplane.jobs.models import Job as JobModel

    job, _ = make_job(status="launching")
    JobModel.objects.filter(pk=job.pk).update(token_hash="")
    assert post(job, "ubk_not_yet", batch([hb(0)])).status_code == 401  # cached without a token
    token = job.issue_token()
    JobModel.objects.filter(pk=job.pk).update(token_hash=job.token_hash)
    assert post(job, token, batch([hb(0)])).status_code == 200
