"""Whole or nothing, and the answer says which: failures after the batch's transaction committed,
made real with a Postgres trigger that refuses rows (no code of ours is faked)."""

import pytest
from django.db import connection

from controlplane.jobs import heartbeats, ingestion
from controlplane.jobs.models import Event, Rank, TrainingSample
from tests.controlplane.conftest import batch, ev, hb, make_job, needs_postgres

pytestmark = [pytest.mark.django_db, needs_postgres(), pytest.mark.postgres]


def refuse_inserts(table: str) -> None:
    """Make the database refuse rows of ``table`` (rolled back with the test's transaction)."""
    with connection.cursor() as cur:
        cur.execute("CREATE FUNCTION test_refuse() RETURNS trigger AS $$ BEGIN "
                    "RAISE EXCEPTION 'refused by the test'; END $$ LANGUAGE plpgsql")
        cur.execute(f"CREATE TRIGGER test_refuse BEFORE INSERT OR UPDATE ON {table} "
                    "FOR EACH ROW EXECUTE FUNCTION test_refuse()")


class UnreachableStore:
    """A heartbeat store whose server is gone (the process boundary: Redis)."""

    in_transaction = False

    def record(self, *a, **k):
        raise ConnectionError("redis is down")


def test_it_answers_503_saying_what_was_stored_when_heartbeats_can_go_nowhere(post):
    job, token = make_job()
    heartbeats.set_store(UnreachableStore())
    refuse_inserts("jobs_rank")  # the database fallback fails too
    r = post(job, token, batch([hb(0, 5)], [ev("e1", "rank_started")]))
    assert r.status_code == 503 and r["Retry-After"] == "1"
    body = r.json()
    assert body["stored"] == {"events": True, "heartbeats": False}
    assert "events stored, heartbeats NOT stored" in body["error"]
    assert Event.objects.filter(job=job, event_id="e1").exists()
    assert not Rank.objects.filter(job=job).exists()


def test_a_failing_training_sample_never_fails_the_batch(post, settle):
    job, token = make_job()
    ingestion._last_sample.pop(job.pk, None)
    before = ingestion.sample_failures
    refuse_inserts("jobs_trainingsample")
    r = post(job, token, batch([hb(0, 5, loss=2.0)]))
    assert r.status_code == 200, r.content
    assert ingestion.sample_failures == before + 1
    assert not TrainingSample.objects.filter(job=job).exists()
    settle()
    assert Rank.objects.get(job=job, rank=0).last_step == 5
