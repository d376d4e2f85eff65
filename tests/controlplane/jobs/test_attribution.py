"""One failure, one primary fault: controlplane.jobs.attribution on faults stored from real batches (the
events ft_launcher's hooks, the in-process layer and the launchers send), in the order they arrive."""

import time
from datetime import UTC, datetime

import pytest
from django.utils import timezone

from controlplane.jobs import evidence, ingestion, supervision
from controlplane.jobs.models import Fault, Job, RestartCycle
from controlplane.launchers import services
from controlplane.launchers.base import LaunchFault
from tests.controlplane.conftest import batch, ev, make_job, needs_postgres
from trainer.wire import parse_batch

pytestmark = pytest.mark.django_db

GLOO_RESET = ("RuntimeError('[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error "
              "[127.0.0.1]:40123: Connection reset by peer')\n\nTraceback (most recent call last):\n"
              '  File "/home/u/train.py", line 80, in <module>\n    loss.backward()\n'
              '  File "/venv/lib/python3.11/site-packages/torch/_tensor.py", line 626, in backward\n'
              "    torch.autograd.backward(\n"
              "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error "
              "[127.0.0.1]:40123: Connection reset by peer")
LOAD_FAILS = ("CheckpointException('no metadata')\n\nTraceback (most recent call last):\n"
              '  File "/home/u/train.py", line 41, in resume\n    dcp.load(state, checkpoint_id=path)\n'
              '  File "/venv/lib/python3.11/site-packages/torch/distributed/checkpoint/state_dict_loader.py",'
              " line 172, in load\n    _load_state_dict(\n"
              "torch.distributed.checkpoint.api.CheckpointException: reading /data/ckpt/step-100: "
              "no metadata")


def record(job, events):
    b = parse_batch(batch(None, events), now=time.time(), world_size=job.world_size)
    ingestion.record_batch(job, b, now=timezone.now())


def fault_ev(eid, rank, cls, message, *, cycle="a0-ij1", at=None, interruption=None, step=160, by="launcher"):
    data = {"fault": cls, "cycle": cycle, "detected_by": by, "rank": rank, "message": message, "step": step}
    if interruption:
        data["interruption"] = interruption
    return ev(eid, "fault", {k: v for k, v in data.items() if v is not None}, at=at, rank=rank)


def primaries(job):
    return list(Fault.objects.filter(job=job, primary__isnull=True).order_by("at", "id"))


def test_it_names_the_killed_rank_even_when_its_exit_arrives_after_its_peers_reset():
    job, _ = make_job(spec={"procs_per_node": 2})
    t = time.time() - 5
    record(job, [fault_ev("f0", 0, "exception", GLOO_RESET, at=t, interruption="exit 1")])
    assert [(f.rank, f.fault_class) for f in primaries(job)] == [(0, "exception")]  # all it knows so far

    record(job, [fault_ev("f1", 1, "process_killed", "rank 1: exit -9 (SIGKILL)", at=t + 0.4,
                          interruption="exit -9 SIGKILL")])
    (p,) = primaries(job)
    assert (p.rank, p.fault_class, p.count) == (1, "process_killed", 1)
    echo = Fault.objects.get(job=job, rank=0)
    assert (echo.primary_id, echo.link) == (p.pk, "consequence")
    assert echo.why == "rank 0: gloo connection reset — a consequence of rank 1's SIGKILL"
    assert echo.attributed_at is not None

    s = evidence.fault_evidence(Fault.objects.select_related("cycle").get(pk=p.pk)).summary
    assert s.startswith("Rank 1 was killed by SIGKILL at step 160; ")
    assert s.endswith("rank 0's gloo connection reset was a consequence.")
    s0 = evidence.fault_evidence(Fault.objects.select_related("cycle").get(pk=echo.pk)).summary
    assert s0 == f"Rank 0: gloo connection reset — a consequence of rank 1's SIGKILL (fault {p.pk})."


def test_an_exception_that_is_not_a_peers_echo_is_the_cause_and_the_stopped_peer_its_consequence():
    job, _ = make_job(spec={"procs_per_node": 2})
    t = time.time() - 5
    boom = ('ValueError(\'bad batch\')\n\nTraceback (most recent call last):\n  File "/home/u/train.py", '
            "line 12, in step\n    raise ValueError('bad batch')\nValueError: bad batch")
    record(job, [fault_ev("a", 0, "process_killed", "rank 0: exit -15 (SIGTERM)", at=t,
                          interruption="exit -15 SIGTERM"),
                 fault_ev("b", 1, "exception", boom, at=t + 1, interruption="exit 1")])
    (p,) = primaries(job)
    assert (p.rank, p.fault_class) == (1, "exception")
    why = Fault.objects.get(job=job, rank=0).why
    assert why == "rank 0: stopped (SIGTERM) — a consequence of rank 1's ValueError"


def test_a_hang_is_the_cause_of_its_peers_collective_timeout():
    job, _ = make_job(spec={"procs_per_node": 2})
    t = time.time() - 60
    record(job, [fault_ev("p", 0, "exception", "RuntimeError('[gloo] Timed out waiting 30000ms for recv')",
                          at=t + 30, interruption="exit 1")])
    record(job, [fault_ev("h", 1, "hang", "rank 1: no heartbeat for 30 s", at=t,
                          interruption="exit -9 SIGKILL")])
    (p,) = primaries(job)
    assert (p.rank, p.fault_class) == (1, "hang")


def test_the_in_process_and_the_in_job_report_of_one_kill_are_one_fault():
    job, _ = make_job(spec={"procs_per_node": 2, "in_process": True})
    t = time.time() - 10
    record(job, [fault_ev("ip", 1, "process_killed", "rank 1: TERMINATED", cycle="a0-ij0-ip1", at=t,
                          interruption="TERMINATED", by="in_process")])
    record(job, [fault_ev("ij", 1, "process_killed", "rank 1: exit -9 (SIGKILL)", cycle="a0-ij1", at=t + 2,
                          interruption="exit -9 SIGKILL"),
                 fault_ev("ij0", 0, "exception", GLOO_RESET, cycle="a0-ij1", at=t + 2.5,
                          interruption="exit 1")])
    (p,) = primaries(job)
    assert p.rank == 1
    whys = sorted(Fault.objects.filter(job=job, primary=p).values_list("why", flat=True))
    assert len(whys) == 2 and any(w.startswith("the same failure, as") for w in whys)


def test_the_same_failure_on_consecutive_restarts_is_one_fault_with_a_count_naming_the_load():
    job, _ = make_job(spec={"procs_per_node": 2})
    t = time.time() - 100
    for i in range(1, 6):
        record(job, [fault_ev(f"l{i}", 1, "exception", LOAD_FAILS, cycle=f"a0-ij{i}", at=t + 20 * i,
                              step=100),
                     fault_ev(f"e{i}", 0, "exception", GLOO_RESET, cycle=f"a0-ij{i}", at=t + 20 * i + 0.1,
                              step=100)])
    (root,) = primaries(job)
    assert root.count == 5 and root.rank == 1
    assert Fault.objects.filter(job=job, primary=root, link="repeat").count() == 4
    assert Fault.objects.filter(job=job, primary=root, link="consequence").count() == 5
    s = evidence.fault_evidence(Fault.objects.select_related("cycle").get(pk=root.pk)).summary
    assert s.startswith("Every restart fails the same way while loading a checkpoint (5 times): the resume "
                        "itself fails (torch.distributed.checkpoint.api.CheckpointException reading "
                        "/data/ckpt/step-100")


def test_failures_with_progress_between_them_or_that_differ_stay_apart():
    job, _ = make_job(spec={"procs_per_node": 2})
    t = time.time() - 100
    record(job, [fault_ev("a", 1, "process_killed", "rank 1: exit -9 (SIGKILL)", cycle="a0-ij1", at=t,
                          interruption="exit -9 SIGKILL")])
    Job.objects.filter(pk=job.pk).update(last_progress_at=datetime.fromtimestamp(t + 30, tz=UTC))
    record(job, [fault_ev("b", 1, "process_killed", "rank 1: exit -9 (SIGKILL)", cycle="a0-ij2", at=t + 40,
                          interruption="exit -9 SIGKILL")])
    record(job, [fault_ev("c", 1, "process_killed", "rank 1: exit 137", cycle="a0-ij3", at=t + 60,
                          interruption="exit 137")])
    assert [(f.count, f.link) for f in primaries(job)] == [(1, ""), (1, ""), (1, "")]


def test_a_kubernetes_oom_kill_seen_after_the_ranks_errors_becomes_the_primary():
    job, _ = make_job(spec={"procs_per_node": 2}, backend="kubernetes")
    t = time.time() - 5
    record(job, [fault_ev("x", 0, "exception", GLOO_RESET, cycle=None, at=t, interruption="exit 1")])
    services.record_launch_fault(job, LaunchFault(
        fault_class="oom_killed", message="pod job-1-a0-1 (node rank 1): container train terminated: reason "
        "OOMKilled, exit code 137", source_key="oom-a0-1", at=t + 1))
    (p,) = primaries(job)
    assert p.fault_class == "oom_killed"
    assert Fault.objects.get(job=job, rank=0).link == "consequence"


def test_the_faults_api_lists_each_faults_summary_and_its_consequences(client):
    from django.contrib.auth.models import User

    job, _ = make_job(spec={"procs_per_node": 2})
    t = time.time() - 5
    record(job, [fault_ev("f0", 0, "exception", GLOO_RESET, at=t, interruption="exit 1"),
                 fault_ev("f1", 1, "process_killed", "rank 1: exit -9 (SIGKILL)", at=t + 0.4,
                          interruption="exit -9 SIGKILL")])
    User.objects.create_user("viewer", password="correct horse battery")
    client.login(username="viewer", password="correct horse battery")
    rows = {f["rank"]: f for f in client.get(f"/api/v1/jobs/{job.pk}/faults").json()["faults"]}
    assert rows[1]["primary"] is None and rows[1]["summary"].startswith("Rank 1 was killed by SIGKILL")
    assert [(c["rank"], c["why"]) for c in rows[1]["consequences"]] == [
        (0, "rank 0: gloo connection reset — a consequence of rank 1's SIGKILL")]
    assert rows[0]["primary"] == rows[1]["id"] and rows[0]["link"] == "consequence"
    page = client.get(f"/jobs/{job.pk}/part/faults/").content.decode()
    assert "a consequence of rank 1&#x27;s SIGKILL" in page and page.count("badge fault") == 1  # folded


def test_a_restart_storm_names_the_fault_it_repeats():
    job, _ = make_job(spec={"procs_per_node": 2, "storm_restarts": 3})
    t = time.time() - 100
    for i in range(1, 4):
        record(job, [ev(f"c{i}", "cycle", {"cycle": f"a0-ij{i}", "mark": "fault_at", "layer": "in_job"},
                        at=t + 20 * i),
                     fault_ev(f"l{i}", 1, "exception", LOAD_FAILS, cycle=f"a0-ij{i}", at=t + 20 * i,
                              step=100)])
    assert RestartCycle.objects.filter(job=job).count() == 3
    supervision.stop_storms()
    job.refresh_from_db()
    root = primaries(job)[0]
    assert job.status == "failed"
    named = f"3 times: fault {root.pk} (exception on rank 1: CheckpointException('no metadata'))"
    assert named in job.status_reason


def test_code_that_cannot_start_fails_the_job_without_counting_job_level_restarts(tmp_path):
    """The local launcher's exit status 3: one fault (the rank's traceback, from ft_launcher's hook), and a
    reason that does not say job-level restarts were used up (none was: a relaunch would fail alike)."""
    job, _ = make_job(spec={"procs_per_node": 2, "max_job_restarts": 3})
    (tmp_path / "exit-0").write_text("3\n")
    Job.objects.filter(pk=job.pk).update(launcher_state={"pid": 0, "exit_file": str(tmp_path / "exit-0"),
                                                         "attempt": 0})
    job.refresh_from_db()
    assert services.supervise_job(job=job) == "failed"
    job.refresh_from_db()
    assert job.status == "failed" and "used up" not in job.status_reason, job.status_reason
    assert job.attempt == 0 and not Fault.objects.filter(job=job).exists()


@needs_postgres()
@pytest.mark.django_db(transaction=True)
def test_two_transactions_that_record_one_failure_at_once_make_one_primary():
    """The watchdog's lost heartbeat and the launcher's report of the same hang, each recorded (and
    attributed) in its own transaction before either commits: neither sees the other's fault then; once
    both commit, the hang is the one primary (seen as two primaries in the attribution matrix)."""
    import threading

    from django.db import connection, transaction

    job, _ = make_job(spec={"procs_per_node": 2})
    t = time.time() - 10
    both_recorded = threading.Barrier(2, timeout=30)
    errors = []

    def one(events):
        try:
            with transaction.atomic():
                record(job, events)
                both_recorded.wait()  # neither has committed yet
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)
        finally:
            connection.close()

    lost = fault_ev("w0", 0, "heartbeat_lost", "no heartbeat from rank 0 for 5.6 s (phase train)", cycle=None,
                    at=t + 0.2, by="watchdog")
    hang = fault_ev("h1", 1, "hang", "rank 1: exit -9 (SIGKILL)\n\nStacks of rank 1's threads when its heartbeats "
                    'stopped:\n  File "/home/u/train.py", line 40 in train_step', at=t, interruption="exit -9 SIGKILL")
    threads = [threading.Thread(target=one, args=([e],)) for e in (lost, hang)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    assert [(f.rank, f.fault_class) for f in primaries(job)] == [(1, "hang")], list(
        Fault.objects.filter(job=job).values("rank", "fault_class", "primary_id", "link"))


def test_a_transaction_that_attributes_a_job_several_times_passes_over_it_once_after_commit(
        django_capture_on_commit_callbacks):
    """Each batch attributes its faults at once and asks for a pass after commit (the overlapping
    transactions above); a transaction that records several batches of one job makes one such pass per
    job, over all their times, not one per batch. Counted by the pass's own read of the job's newest
    faults, run as the commit would run the hooks."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    job, _ = make_job(spec={"procs_per_node": 2})
    other, _ = make_job(spec={"procs_per_node": 2})
    t = time.time() - 100
    with django_capture_on_commit_callbacks() as hooks:
        for i in range(1, 4):
            record(job, [fault_ev(f"l{i}", 1, "exception", LOAD_FAILS, cycle=f"a0-ij{i}", at=t + 20 * i,
                                  step=100)])
        record(other, [fault_ev("o1", 0, "exception", GLOO_RESET, cycle="a0-ij1", at=t)])
    with CaptureQueriesContext(connection) as queries:
        for hook in hooks:
            hook()

    def passes(j):
        return [q for q in queries.captured_queries if 'FROM "jobs_fault"' in q["sql"]
                and f'"jobs_fault"."job_id" = {j.pk}' in q["sql"] and "LIMIT" in q["sql"]]

    assert (len(passes(job)), len(passes(other))) == (1, 1), [q["sql"] for q in queries.captured_queries]
    (root,) = primaries(job)  # the one pass saw all three failures: one root, counted three times
    assert root.count == 3
