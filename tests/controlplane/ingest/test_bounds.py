"""Every value that reaches storage is bounded at the edge (trainer/wire.py): one test per repro of
"one job's bad input must never touch another job". Each gets a 422 naming the field, and nothing is
stored: no heartbeat state (Redis or rows), no event, fault, checkpoint or training sample."""

import json
import time

import pytest

from controlplane.jobs import ingestion
from controlplane.jobs.heartbeats import RedisHeartbeatStore
from controlplane.jobs.models import Checkpoint, Event, Fault, Rank, TrainingSample
from tests.controlplane.conftest import batch, ev, hb, make_job

pytestmark = pytest.mark.django_db


def assert_nothing_stored(job, store):
    assert not Event.objects.filter(job=job).exists()
    assert not Fault.objects.filter(job=job).exists()
    assert not Checkpoint.objects.filter(job=job).exists()
    assert not TrainingSample.objects.filter(job=job).exists()
    store.flush()
    assert not Rank.objects.filter(job=job).exists()
    if isinstance(store, RedisHeartbeatStore):
        assert store.redis.exists(*store.keys(job.pk)) == 0


@pytest.fixture(autouse=True)
def _sample_due():
    """Make the 2-second training sample due, as in the issue's partial write."""
    ingestion._last_sample.clear()


@pytest.mark.parametrize("beat, field, words", [
    ({"step": 2**63}, "step", "<= 2147483647"),
    ({"step": 2**64 - 1}, "step", "<= 2147483647"),
    ({"step": 2**31}, "step", "<= 2147483647"),  # the Rank.last_step column is an integer
    ({"pid": 2**63}, "pid", "<= 2147483647"),
    ({"node": "host\x00a"}, "node", "NUL"),
    ({"at": -1e12}, "at", "older than the server accepts"),
    ({"at": 0}, "at", "older than the server accepts"),  # 1970: was accepted, and made a heartbeat_lost fault
    ({"step_time_s": -1.0}, "step_time_s", ">= 0"),
    ({"tokens_per_s": 1e300}, "tokens_per_s", "<= 1e+15"),
])
def test_it_refuses_an_unstorable_heartbeat_naming_the_field(post, hb_store, beat, field, words):
    job, token = make_job()
    r = post(job, token, json.dumps(batch([hb(0, 5, loss=2.0), {**hb(1, 5), **beat}])).encode())
    assert r.status_code == 422, r.content
    assert r.json()["field"] == f"heartbeats[1].{field}"
    assert words in r.json()["error"]
    assert_nothing_stored(job, hb_store)


def test_it_refuses_the_issues_heartbeat_repro(post, hb_store):
    job, token = make_job(spec={"procs_per_node": 8})
    now = time.time()
    r = post(job, token, {"v": 1, "sent_at": now,
                          "heartbeats": [{"rank": 4, "step": 9223372036854775808, "phase": "train", "at": now}]})
    assert r.status_code == 422
    assert r.json() == {"error": "must be <= 2147483647", "field": "heartbeats[0].step"}
    assert_nothing_stored(job, hb_store)


@pytest.mark.parametrize("event, field, words", [
    (ev("k1", "checkpoint", {"step": 2**63, "state": "durable"}), "events[0].data.step", "<= 2147483647"),
    (ev("k\x001", "rank_started"), "events[0].id", "NUL"),
    (ev("l1", "launcher", {"message": "exit\x00code"}), "events[0].data.message", "NUL"),
    (ev("l1", "launcher", {"a": {"b\x00": 1}}), "events[0].data.a", "NUL"),
    (ev("f1", "fault", {"fault": "exception"}, at=-1e12), "events[0].at", "older than the server accepts"),
    (ev("l1", "launcher", {"a": {"b": {"c": {"d": {}}}}}), "events[0].data.a.b.c.d", "deeper than 4"),
    (ev("l1", "launcher", {"m": ["x" * 4000] * 5}), "events[0].data", "at most 16384"),
    (ev("l1", "launcher", {"n": [2**63]}), "events[0].data.n[0]", "<= 9223372036854775807"),
    (ev("k1", "checkpoint", {"step": 1, "state": "durable", "write_s": 1e300}), "events[0].data.write_s",
     "<= 1e+07"),
    (ev("k1", "checkpoint", {"step": 1, "state": "durable", "bytes": 2**63}), "events[0].data.bytes",
     "<= 9223372036854775807"),
    (ev("a1", "command_ack", {"command_id": 2**63, "ok": True}), "events[0].data.command_id",
     "<= 9223372036854775807"),
])
def test_it_refuses_an_unstorable_event_naming_the_field(post, hb_store, event, field, words):
    job, token = make_job()
    r = post(job, token, json.dumps(batch([hb(0, 5)], [event])).encode())
    assert r.status_code == 422, r.content
    assert r.json()["field"] == field
    assert words in r.json()["error"]
    assert_nothing_stored(job, hb_store)


def test_it_lists_allowed_values_as_plain_words(post, hb_store):
    job, token = make_job()
    r = post(job, token, batch([hb(0, phase="dancing")]))
    assert r.json() == {"error": "must be one of checkpoint_load, checkpoint_save, data, eval, init, restarting, stopped, train",
                        "field": "heartbeats[0].phase"}
    r = post(job, token, batch(events=[ev("c1", "cycle", {"cycle": "a0-ij1", "mark": "lunch_at"})]))
    assert r.json()["error"] == ("must be one of aborted_at, checkpoint_loaded_at, detected_at, fault_at, "
                                 "first_step_at, restarted_at")
    assert "<" not in post(job, token, batch(events=[ev("e1", "nonsense")])).json()["error"]
    assert_nothing_stored(job, hb_store)


def test_it_refuses_a_timestamp_older_than_the_configured_max_age(post, hb_store, settings):
    settings.INGEST_MAX_AGE_S = 60.0
    job, token = make_job()
    r = post(job, token, batch([hb(0, at=time.time() - 120)]))
    assert r.status_code == 422 and r.json()["field"] == "heartbeats[0].at"
    assert_nothing_stored(job, hb_store)


def test_it_accepts_a_spool_replayed_after_a_long_outage(post, settle):
    """The default window (7 days) takes a reporter's spool back: a refused batch would be dropped."""
    job, token = make_job()
    old = time.time() - 6 * 86400
    r = post(job, token, batch([hb(0, 5, at=old)], [ev("f1", "fault", {"fault": "exception"}, at=old)]))
    assert r.status_code == 200, r.content
    settle()
    assert Rank.objects.get(job=job, rank=0).last_step == 5


def test_an_old_beat_in_the_window_makes_no_fault_for_a_rank_that_is_beating(post, settle):
    from controlplane.jobs import supervision

    job, token = make_job()
    now = time.time()
    assert post(job, token, batch([hb(0, 50, at=now)])).status_code == 200
    assert post(job, token, batch([hb(0, 10, at=now - 3 * 86400)])).status_code == 200  # a late replay
    settle()
    supervision.run_watchdog()
    assert not Fault.objects.filter(job=job).exists()
    r = Rank.objects.get(job=job, rank=0)
    assert r.last_step == 50 and r.lost_at is None


def test_a_new_rank_whose_only_beat_is_old_is_lost_until_it_beats_again(post, settle):
    """Decided: a rank first seen through an old beat (a replay) is judged by it, as any rank is by its
    newest beat: past its deadline, it is lost (it may have died during the outage, and that must be
    reported). A live rank's next beat follows its replay at once and clears the claim; the fault
    stays in the history as what the control plane saw."""
    from controlplane.jobs import supervision

    job, token = make_job()
    assert post(job, token, batch([hb(2, 7, at=time.time() - 3600)])).status_code == 200
    settle()
    supervision.run_watchdog()
    assert Fault.objects.get(job=job).fault_class == "heartbeat_lost"
    assert post(job, token, batch([hb(2, 8)])).status_code == 200
    settle()
    assert Rank.objects.get(job=job, rank=2).lost_at is None


def test_the_schema_states_the_bounds_the_server_applies(client, settings):
    from trainer import wire

    before = time.time()
    doc = client.get("/api/v1/openapi.json").json()
    s = doc["components"]["schemas"]
    server_time = doc["info"]["x-server-time"]
    assert before <= server_time <= time.time()
    sent_at = s["Batch"]["properties"]["sent_at"]
    assert server_time - wire.MAX_CLOCK_SKEW_S < sent_at["minimum"] < sent_at["maximum"] < \
        server_time + wire.MAX_CLOCK_SKEW_S
    for name in ("Heartbeat", "Event"):
        at = s[name]["properties"]["at"]
        assert at["minimum"] >= server_time - settings.INGEST_MAX_AGE_S
        assert at["maximum"] <= server_time + wire.MAX_CLOCK_SKEW_S + wire.MAX_FUTURE_S
    hb_props = s["Heartbeat"]["properties"]
    assert hb_props["step"]["maximum"] == wire.MAX_STEP == 2**31 - 1
    assert hb_props["pid"]["maximum"] == wire.MAX_PID and hb_props["rank"]["maximum"] == wire.MAX_RANK
    assert hb_props["node"]["maxLength"] == wire.MAX_NODE_LEN and "x00" in hb_props["node"]["pattern"]
    responses = doc["paths"]["/api/v1/jobs/{job_id}/ingest"]["post"]["responses"]
    assert {"200", "400", "401", "405", "413", "422", "500", "503"} <= set(responses)
    assert "stored" in s["Error"]["properties"]
    later = client.get("/api/v1/openapi.json").json()  # computed when served, not cached
    assert later["info"]["x-server-time"] > server_time
