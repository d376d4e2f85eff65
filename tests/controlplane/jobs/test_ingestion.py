"""Facts derived from batches: controlplane.jobs.ingestion (no HTTP)."""

import copy
import random
import time

import pytest
from django.utils import timezone

from controlplane.jobs import ingestion
from controlplane.jobs.models import Checkpoint, Fault, Job, Notification, Rank, RestartCycle
from tests.controlplane.conftest import batch, ev, hb, make_job
from trainer.wire import HEARTBEAT_RULES, WireError, parse_batch

pytestmark = pytest.mark.django_db


def record(job, heartbeats=None, events=None):
    b = parse_batch(batch(heartbeats, events), now=time.time(), world_size=job.world_size)
    return ingestion.record_batch(job, b, now=timezone.now())


def cycle_ev(eid, key, mark, at, **data):
    return ev(eid, "cycle", {"cycle": key, "mark": mark, "layer": data.pop("layer", "in_process"), **data}, at=at)


def test_it_opens_a_cycle_and_recovers_with_a_notification():
    job, _ = make_job(notify_webhook_url="http://127.0.0.1:9/hook")
    t = time.time() - 30
    record(job, events=[cycle_ev("c1", "a0-ij0-ip1", "fault_at", t, step=40),
                        cycle_ev("c2", "a0-ij0-ip1", "detected_at", t + 1)])
    job.refresh_from_db()
    assert job.status == "recovering"
    record(job, events=[cycle_ev("c3", "a0-ij0-ip1", "checkpoint_loaded_at", t + 3, step=20, restored_from="memory"),
                        cycle_ev("c4", "a0-ij0-ip1", "first_step_at", t + 5, step=21)])
    job.refresh_from_db()
    assert job.status == "running"
    c = RestartCycle.objects.get(job=job)
    assert (c.layer, c.step_at_fault, c.resumed_from_step, c.lost_steps) == ("in_process", 40, 20, 20)
    assert c.restored_from == "memory"
    assert c.recovery_s == pytest.approx(5, abs=1e-3)
    n = Notification.objects.get(job=job)
    assert n.transition == "recovered" and "recovered in 5.0 s" in n.payload["text"]


def test_it_does_not_reopen_recovery_for_a_late_event_of_a_closed_cycle():
    job, _ = make_job()
    t = time.time() - 60
    record(job, events=[cycle_ev("a", "a0-ij1", "fault_at", t), cycle_ev("b", "a0-ij1", "first_step_at", t + 9)])
    assert Job.objects.get(pk=job.pk).status == "running"
    record(job, events=[cycle_ev("c", "a0-ij1", "detected_at", t + 1)])  # arrives late
    assert Job.objects.get(pk=job.pk).status == "running"


def test_it_stays_recovering_while_a_later_cycle_is_open():
    job, _ = make_job()
    t = time.time() - 60
    record(job, events=[cycle_ev("a", "a0-ij0-ip1", "fault_at", t), cycle_ev("b", "a0-ij1", "fault_at", t + 10,
                                                                           layer="in_job")])
    record(job, events=[cycle_ev("c", "a0-ij0-ip1", "first_step_at", t + 5)])  # the old one, out of order
    assert Job.objects.get(pk=job.pk).status == "recovering"
    record(job, events=[cycle_ev("d", "a0-ij1", "first_step_at", t + 20)])
    assert Job.objects.get(pk=job.pk).status == "running"


def test_a_job_wide_restart_folds_into_one_cycle_and_repeated_marks_cost_one_read():
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    job, _ = make_job(spec={"procs_per_node": 64})
    t = time.time() - 60
    marks = (("fault_at", 0.0), ("detected_at", 0.1), ("restarted_at", 1.0), ("first_step_at", 2.0))

    def node(n, skew):  # one node's 8 ranks, each reporting the same restart a little apart
        return [cycle_ev(f"n{n}-r{r}-{m}", "a0-ij1", m, t + dt + skew + r / 100, layer="in_job",
                         **({"step": 7} if m == "fault_at" else {}))
                for r in range(8) for m, dt in marks]

    record(job, events=node(0, 0.5))
    record(job, events=node(1, 0.7))  # later marks than the cycle's: nothing to write
    with CaptureQueriesContext(connection) as q:
        record(job, events=node(2, 0.9))
    writes = [x["sql"] for x in q.captured_queries if x["sql"].lstrip().upper().startswith("UPDATE")]
    assert writes == []
    record(job, events=node(3, 0.0))  # an earlier node moves every mark back
    c = RestartCycle.objects.get(job=job)
    assert c.fault_at.timestamp() == pytest.approx(t) and c.first_step_at.timestamp() == pytest.approx(t + 2)
    assert (c.layer, c.step_at_fault) == ("in_job", 7)
    assert RestartCycle.objects.filter(job=job).count() == 1
    assert Job.objects.get(pk=job.pk).status == "running"
    assert job.events.filter(kind="cycle").count() == 4 * 8 * len(marks)


def test_it_attaches_faults_to_their_cycle_once():
    job, _ = make_job()
    t = time.time() - 10
    f = ev("f1", "fault", {"fault": "exception", "cycle": "a0-ij0-ip1", "message": "boom", "detected_by": "in_process"},
           at=t + 2, rank=1)
    record(job, events=[f, cycle_ev("c1", "a0-ij0-ip1", "fault_at", t)])
    record(job, events=[f])
    fault = Fault.objects.get(job=job)
    assert fault.cycle.key == "a0-ij0-ip1" and fault.rank == 1 and fault.source_key == "event:f1"
    assert fault.at.timestamp() == pytest.approx(t) and fault.detected_at.timestamp() == pytest.approx(t + 2)
    assert fault.cycle.reason == "exception: boom"


def test_it_moves_checkpoints_forward_only():
    job, _ = make_job()
    t = time.time() - 10
    record(job, events=[ev("k2", "checkpoint", {"step": 20, "state": "durable", "write_s": 1.5, "bytes": 10}, at=t + 2)])
    record(job, events=[ev("k1", "checkpoint", {"step": 20, "state": "in_flight", "mode": "async"}, at=t)])
    record(job, events=[ev("k3", "checkpoint", {"step": 20, "state": "failed"}, at=t + 3)])
    c = Checkpoint.objects.get(job=job, step=20)
    assert c.state == "durable" and c.bytes == 10
    assert c.started_at.timestamp() == pytest.approx(t) and c.durable_latency_s == pytest.approx(2)


def test_it_records_rank_finished_without_changing_the_status():
    job, _ = make_job()
    assert record(job, events=[ev(f"fin{r}", "rank_finished", {"step": 9}, rank=r) for r in range(4)]).events == 4
    assert Job.objects.get(pk=job.pk).status == "running"


def test_it_keeps_the_stall_clock_while_the_step_holds_and_clears_claims_on_progress(settle):
    job, _ = make_job()
    t = time.time() - 20
    record(job, [hb(0, 5, at=t)])
    settle()
    Rank.objects.filter(job=job).update(stalled_at=timezone.now(), lost_at=timezone.now())
    record(job, [hb(0, 5, at=t + 10)])
    settle()
    r = Rank.objects.get(job=job, rank=0)
    assert r.step_changed_at.timestamp() == pytest.approx(t, abs=1e-3)
    assert r.stall_at.timestamp() == pytest.approx(t + 120, abs=1e-3)
    assert r.stalled_at is not None and r.lost_at is None  # alive again, still stuck
    record(job, [hb(0, 6, at=t + 11)])
    settle()
    r.refresh_from_db()
    assert r.stalled_at is None and r.last_step == 6 and r.step_changed_at.timestamp() > t + 5


def test_it_uses_the_checkpoint_timeout_while_saving(settle):
    job, _ = make_job(spec={"step_timeout_s": 10.0, "checkpoint_timeout_s": 200.0})
    t = time.time()
    record(job, [hb(0, 5, "checkpoint_save", at=t), hb(1, 5, "train", at=t), hb(2, 5, "stopped", at=t)])
    settle()
    rows = {r.rank: r for r in Rank.objects.filter(job=job)}
    assert rows[0].stale_at.timestamp() == pytest.approx(t + 200, abs=1e-3)
    assert rows[1].stale_at.timestamp() == pytest.approx(t + 10, abs=1e-3)
    assert rows[2].stale_at is None
    assert rows[0].stall_at is None and rows[1].stall_at is not None


def test_it_tracks_job_progress(settle):
    job, _ = make_job()
    t = time.time() - 10
    record(job, [hb(0, 10, at=t), hb(1, 12, at=t)])
    record(job, [hb(0, 4, at=t + 5), hb(1, 4, at=t + 5)])  # rolled back after a restart
    settle()
    job.refresh_from_db()
    assert (job.max_step, job.last_step) == (12, 4)
    assert job.last_progress_at.timestamp() == pytest.approx(t, abs=1e-3)
    assert job.first_step_at.timestamp() == pytest.approx(t, abs=1e-3)


def test_the_jobs_first_step_is_the_first_train_beat_of_a_batch_not_each_ranks_newest(settle):
    """A reporter's batch holds a second of each rank's beats: the job's first step is its first train
    beat, whichever beat of the batch it is (either store)."""
    job, _ = make_job()
    t = time.time() - 60
    record(job, [hb(r, s, at=t + s) for s in (1, 20, 30) for r in (0, 1)])
    settle()
    job.refresh_from_db()
    assert job.first_step_at.timestamp() == pytest.approx(t + 1, abs=1e-3)
    assert (job.max_step, job.last_step) == (30, 30)
    assert job.last_progress_at.timestamp() == pytest.approx(t + 30, abs=1e-3)


def test_it_falls_back_to_the_database_when_the_heartbeat_store_fails():
    class Broken:
        in_transaction = False

        def record(self, *a, **k):
            raise ConnectionError("redis is down")

    job, _ = make_job()
    b = parse_batch(batch([hb(0, 3)]), now=time.time(), world_size=4)
    ingestion.record_batch(job, b, now=timezone.now(), store=Broken())
    assert Rank.objects.get(job=job, rank=0).last_step == 3


def _mutations(base):
    yield base
    values = [None, True, False, -1, 0, 1, 2**40, 1.5, "x", "", [], {}, float(time.time()), "train", 4,
              # the bounds (trainer/wire.py): column ranges, the time window, NUL, the float caps
              2**31 - 1, 2**31, 2**63, -1e12, 0.0, base["sent_at"] - 8 * 86400, base["sent_at"] - 86400,
              "n\x00", "x" * 254, 1e7, 1e7 + 1, 1e15 + 1, -0.5]
    rnd = random.Random(7)
    keys = [*HEARTBEAT_RULES, "extra"]
    for _ in range(3000):
        obj = copy.deepcopy(base)
        what = rnd.random()
        if what < 0.7:
            h = rnd.choice(obj["heartbeats"])
            k = rnd.choice(keys)
            if rnd.random() < 0.15:
                h.pop(k, None)
            else:
                h[k] = rnd.choice(values)
        elif what < 0.85:
            obj[rnd.choice(["v", "sent_at", "source", "heartbeats", "events"])] = rnd.choice(values)
        else:
            obj["heartbeats"][0]["at"] = obj["sent_at"] + rnd.choice([4.9, 5.1, 100, -7 * 86400 + 1, -7 * 86400 - 1])
        yield obj


def test_its_fast_validator_never_accepts_what_the_wire_module_refuses():
    now = time.time()
    base = batch([hb(r, 10 + r, at=now - 1, loss=2.5, node="n1", pid=7) for r in range(4)], sent_at=now)
    accepted = 0
    for obj in _mutations(base):
        fast = ingestion.parse_heartbeats_fast(obj, now=now, world_size=4)
        try:
            slow = parse_batch(obj, now=now, world_size=4)
        except (WireError, TypeError):  # TypeError: wire.py looks up unhashable values in its sets
            slow = None
        if fast is not None:
            accepted += 1
            assert slow is not None and not slow.events, obj
            assert [(b["rank"], b["step"], b["phase"], float(b["at"])) for b in fast] == \
                [(h.rank, h.step, h.phase, h.at) for h in slow.heartbeats]
    assert accepted > 100  # the fast path is actually taken for good batches


def test_it_closes_an_in_process_cycle_that_escalated_to_the_launcher():
    job, _ = make_job()
    t = time.time() - 60
    record(job, events=[cycle_ev("k1", "a0-ij1", "fault_at", t, layer="in_job"),
                        cycle_ev("p1", "a0-ij0-ip1", "detected_at", t + 0.2),
                        cycle_ev("p2", "a0-ij0-ip1", "aborted_at", t + 0.3)])
    record(job, events=[cycle_ev("k2", "a0-ij1", "first_step_at", t + 5, layer="in_job")])
    job.refresh_from_db()
    assert job.status == "running"
    gave_up = RestartCycle.objects.get(job=job, key="a0-ij0-ip1")
    assert gave_up.escalated_to == "a0-ij1"
    assert gave_up.recovery_s == pytest.approx(0.1, abs=1e-3)  # ends at its own last mark, not "now"
    assert RestartCycle.objects.get(job=job, key="a0-ij1").escalated_to == ""


def test_it_keeps_one_training_sample_per_interval_of_the_trainers_clock():
    from controlplane.jobs.models import TrainingSample

    job, _ = make_job()
    t = (time.time() // ingestion.SAMPLE_INTERVAL_S) * ingestion.SAMPLE_INTERVAL_S - 60
    record(job, heartbeats=[hb(1, 5, at=t, loss=3.0), hb(0, 5, at=t, loss=2.5)])
    record(job, heartbeats=[hb(0, 6, at=t + 0.1, loss=2.4)])  # the same 2 s slot: not kept
    s = TrainingSample.objects.get(job=job)
    assert (s.rank, s.step, s.loss) == (0, 5, 2.5)
    record(job, heartbeats=[hb(0, 7, at=t + 2.5, loss=2.3)])
    assert list(TrainingSample.objects.filter(job=job).values_list("step", flat=True)) == [5, 7]
    # A trainer's spool replays an outage in one batch later: its beats fill the places they belong to.
    record(job, heartbeats=[hb(0, 8 + i, at=t + 4.6 + i, loss=2.0) for i in range(6)])
    got = list(TrainingSample.objects.filter(job=job).order_by("at").values_list("step", "at"))
    assert [step for step, _ in got] == [5, 7, 8, 10, 12]
    assert got[-1][1].timestamp() == pytest.approx(t + 8.6, abs=1e-3)  # placed by the beat's own time


def test_the_training_sample_is_per_job_not_per_web_process():
    from controlplane.jobs.models import TrainingSample

    job, _ = make_job()
    ingestion._last_sample.clear()  # SQLite reuses a rolled-back test's job id: forget its samples
    t = time.time()
    record(job, heartbeats=[hb(0, 5, at=t, loss=2.5)])
    ingestion._last_sample.clear()  # another web process: it has sampled nothing itself
    record(job, heartbeats=[hb(0, 6, at=t + 0.5, loss=2.4)])
    assert list(TrainingSample.objects.filter(job=job).values_list("step", flat=True)) == [5]
