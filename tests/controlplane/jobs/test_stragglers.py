"""Stragglers: one rule (jobs/rank_health.py) read live by the rank table, the API and /metrics, and turned into
marked/cleared history by the watchdog (jobs/stragglers.py) for the timeline."""

import time
from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.dashboard.metrics import render_metrics
from controlplane.dashboard.parts import rank_table
from controlplane.jobs import ingestion, rank_health, readouts, supervision
from controlplane.jobs.models import Event, Rank
from controlplane.jobs.spec import JobSpec, SpecError
from controlplane.jobs.stragglers import STRAGGLER_EVENT, straggler_spans
from tests.controlplane.conftest import batch, hb, make_job
from tests.controlplane.dashboard.factories import operator_client
from trainer.wire import parse_batch

pytestmark = pytest.mark.django_db


def beat(job, *beats):
    ingestion.record_batch(job, parse_batch(batch(list(beats)), now=time.time(), world_size=job.world_size),
                           now=timezone.now())


def table(job, now):
    job = type(job).objects.get(pk=job.pk)
    return {r["rank"]: (r["health"], r["slowdown_pct"]) for r in rank_table.ranks_part(job, now)["rows"]}


def test_it_finds_the_rank_above_the_median_of_the_others():
    assert rank_health.slowdowns({0: 0.10, 1: 0.13}, 20) == {1: 30.0}
    assert rank_health.slowdowns({0: 0.10, 1: 0.11}, 20) == {}
    assert rank_health.slowdowns({0: 0.10, 1: 0.10, 2: 0.10, 3: 0.25}, 20) == {3: 150.0}
    # Two slow ranks of five: each compared with the median of the four others.
    assert rank_health.slowdowns({0: 1.0, 1: 1.0, 2: 1.0, 3: 2.0, 4: 2.0}, 20) == {4: 100.0, 3: 100.0}


def test_it_needs_two_ranks_and_a_margin():
    assert rank_health.slowdowns({0: 5.0}, 20) == {}
    assert rank_health.slowdowns({0: 0.1, 1: 0.5}, 0) == {}
    assert rank_health.slowdowns({0: 0.0, 1: 0.5}, 20) == {}  # no work measured on the peer: no median to judge by


def test_it_marks_a_straggler_in_the_rank_table_and_clears_it_when_it_recovers():
    job, _ = make_job(spec={"procs_per_node": 3})
    t = time.time()
    beat(job, hb(0, 10, at=t, busy_s=0.10), hb(1, 10, at=t, busy_s=0.10), hb(2, 10, at=t, busy_s=0.14))
    assert table(job, timezone.now()) == {0: ("ok", None), 1: ("ok", None), 2: ("straggler", 40.0)}
    beat(job, hb(2, 11, at=t + 1, busy_s=0.105))
    assert table(job, timezone.now())[2] == ("ok", None)


def test_a_rank_that_is_lost_is_lost_not_a_straggler():
    job, _ = make_job(spec={"procs_per_node": 2, "step_timeout_s": 10.0})
    t = time.time() - 30
    beat(job, hb(0, 10, at=time.time(), busy_s=0.1), hb(1, 10, at=t, busy_s=0.5))
    assert table(job, timezone.now()) == {0: ("ok", None), 1: ("lost", None)}


def test_a_rank_past_its_deadline_is_nobody_s_peer_in_metrics_either(settle):
    """Read without the page's rows (``/metrics``), the other ranks are judged by the same rule as the
    page's: a rank past its deadline that the watchdog has not marked yet is no straggler, and no peer."""
    job, _ = make_job(spec={"procs_per_node": 3, "step_timeout_s": 10.0})
    now = time.time()
    beat(job, hb(0, 10, at=now, busy_s=0.13), hb(1, 10, at=now, busy_s=0.10),
         hb(2, 10, at=now - 30, busy_s=0.20))  # rank 2: past its 10 s deadline, not marked lost yet
    settle()
    assert readouts.slowdowns(job, [], timezone.now()) == {0: 30.0}
    assert table(job, timezone.now()) == {0: ("straggler", 30.0), 1: ("ok", None), 2: ("lost", None)}


def test_the_margin_comes_from_the_spec():
    job, _ = make_job(spec={"procs_per_node": 2, "straggler_margin_pct": 50.0})
    t = time.time()
    beat(job, hb(0, 10, at=t, busy_s=0.10), hb(1, 10, at=t, busy_s=0.14))
    assert table(job, timezone.now())[1] == ("ok", None)
    off, _ = make_job(spec={"procs_per_node": 2, "straggler_margin_pct": 0.0})
    beat(off, hb(0, 10, at=t, busy_s=0.10), hb(1, 10, at=t, busy_s=0.90))
    assert table(off, timezone.now())[1] == ("ok", None)


def test_the_spec_refuses_a_margin_inside_the_noise_and_a_bad_window():
    with pytest.raises(SpecError) as e:
        JobSpec(straggler_margin_pct=2.0, straggler_window_s=0.5)
    assert set(e.value.errors) == {"straggler_margin_pct", "straggler_window_s"}
    with pytest.raises(SpecError) as e:
        JobSpec.from_dict({"steps": 100, "drills": [{"step": 5, "fault": "slow_rank", "rank": 1, "fraction": 0}]})
    assert "drills[0].fraction" in e.value.errors
    spec = JobSpec.from_dict({"steps": 100, "drills": [{"step": 5, "fault": "slow_rank", "rank": 1}]})
    assert spec.drills[0].as_flag() == "5:slow_rank:1:0.3"


def test_the_watchdog_marks_and_clears_once_and_the_timeline_draws_it(settle):
    job, _ = make_job(spec={"procs_per_node": 2})
    t = time.time()
    beat(job, hb(0, 10, at=t, busy_s=0.10), hb(1, 10, at=t, busy_s=0.20))
    settle()
    now = timezone.now()
    assert supervision.run_watchdog(now).stragglers == 1
    assert supervision.run_watchdog(now + timedelta(seconds=1)).stragglers == 0  # already marked
    assert Rank.objects.get(job=job, rank=1).straggler_at == now
    marked = Event.objects.get(job=job, kind=STRAGGLER_EVENT)
    assert (marked.rank, marked.data) == (1, {"state": "marked", "slowdown_pct": 100.0})
    beat(job, hb(1, 11, at=t + 1, busy_s=0.10))
    settle()
    assert supervision.run_watchdog(now + timedelta(seconds=2)).stragglers == 1
    assert Rank.objects.get(job=job, rank=1).straggler_at is None
    states = list(Event.objects.filter(job=job, kind=STRAGGLER_EVENT).order_by("at").values_list("data__state", flat=True))
    assert states == ["marked", "cleared"]
    t0 = now.timestamp()
    assert straggler_spans([(1, t0, "marked"), (1, t0 + 2, "cleared"), (0, t0 + 3, "marked")], end=t0 + 9) == [
        (1, t0, t0 + 2), (0, t0 + 3, None)]
    page = operator_client().get(f"/jobs/{job.pk}/")
    assert page.status_code == 200


def test_metrics_count_stragglers_and_their_worst_slowdown_per_job(settle):
    job, _ = make_job(spec={"procs_per_node": 3})
    t = time.time()
    beat(job, hb(0, 10, at=t, busy_s=0.10), hb(1, 10, at=t, busy_s=0.10), hb(2, 10, at=t, busy_s=0.15))
    settle()
    text = render_metrics(timezone.now()).decode()
    assert f'unbroken_ranks_straggling{{job="{job.pk}"}} 1.0' in text
    assert f'unbroken_straggler_slowdown_max_percent{{job="{job.pk}"}} 50.0' in text


def test_the_api_shows_a_rank_s_work_and_slowdown(settle):
    job, _ = make_job(spec={"procs_per_node": 2})
    t = time.time()
    beat(job, hb(0, 10, at=t, busy_s=0.10), hb(1, 10, at=t, busy_s=0.13))
    settle()
    ranks = operator_client().get(f"/api/v1/jobs/{job.pk}/ranks").json()["ranks"]
    assert [(r["health"], r["busy_s"], r["slowdown_pct"]) for r in ranks] == [
        ("ok", 0.10, None), ("straggler", 0.13, 30.0)]


def test_a_straggler_rule_of_the_failure_policy_acts_when_the_watchdog_marks_one(settle):
    from controlplane.jobs.models import Command, Notification
    from trainer.policy_rules import parse_rules

    job, _ = make_job(spec={"procs_per_node": 2, "failure_policy": parse_rules([
        {"match": {"class": "straggler"}, "action": "notify"}])}, notify_email="ops@example.com")
    t = time.time()
    beat(job, hb(0, 10, at=t, busy_s=0.10), hb(1, 10, at=t, busy_s=0.20))
    settle()
    assert supervision.run_watchdog(timezone.now()).stragglers == 1
    n = Notification.objects.get(job=job)
    assert n.transition == "policy" and "straggler rank 1 (100 % slower)" in n.payload["text"]
    decision = Event.objects.get(job=job, kind="policy").data
    assert (decision["action"], decision["rule"]) == ("notify", 1)
    assert not Command.objects.filter(job=job).exists()


def test_the_sql_health_filter_agrees_with_health_at_for_every_kind_of_row():
    """``Rank.objects.ok_or_late`` (the watchdog's straggler pass) and ``Rank.health_at`` (everything
    else) are one rule written twice: every combination of the fields they read gets the same answer."""
    import itertools

    job, _ = make_job(spec={"procs_per_node": 512})
    now = timezone.now()
    before, after = now - timedelta(seconds=5), now + timedelta(seconds=5)
    rows = []
    combos = itertools.product(["train", "stopped"], [None, before], [None, before, now, after],
                               [None, before], [None, before, now, after])
    for i, (phase, lost, stale, stalled, stall) in enumerate(combos):
        rows.append(Rank(job=job, rank=i, phase=phase, lost_at=lost, stale_at=stale, stalled_at=stalled,
                         stall_at=stall, last_heartbeat_at=now - timedelta(seconds=1)))
    Rank.objects.bulk_create(rows)
    in_sql = set(Rank.objects.filter(job=job).ok_or_late(now).values_list("rank", flat=True))
    in_python = {r.rank for r in Rank.objects.filter(job=job) if r.health_at(now) in ("ok", "late")}
    assert in_sql == in_python and 0 < len(in_sql) < len(rows)
