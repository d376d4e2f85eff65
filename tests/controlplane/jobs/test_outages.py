"""Outage grace and degraded mode: controlplane.jobs.outages with the watchdog, /metrics and the pages."""

import logging
from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.dashboard.parts.timeline_part import timeline_part
from controlplane.jobs import outages, readouts, supervision
from controlplane.jobs.models import Beacon, Fault, Outage, Rank
from tests.controlplane.conftest import hb, make_job
from tests.controlplane.jobs.test_supervision import beat

pytestmark = pytest.mark.django_db


def at(t0, s):
    return t0 + timedelta(seconds=s)


def passes(t0, start, end, step=1.0, *, ingest=False):
    """Watchdog passes every ``step`` seconds from ``start`` to ``end`` (inclusive); the ranks marked lost.
    ``ingest``: the web ticks its beacon before each pass (ingest is up)."""
    n, s = 0, start
    while s <= end + 1e-9:
        if ingest:
            outages.tick("ingest", at(t0, s))
        n += supervision.run_watchdog(at(t0, s)).lost
        s += step
    return n


def lost(job):
    return Fault.objects.filter(job=job, fault_class="heartbeat_lost").count()


@pytest.fixture(autouse=True)
def _fresh_process_state():
    outages._down.clear()
    yield
    outages._down.clear()


def test_it_does_not_count_time_the_watchdog_did_not_run_against_a_deadline(settle):
    job, _ = make_job(spec={"step_timeout_s": 5.0, "procs_per_node": 2})
    t0 = timezone.now() - timedelta(seconds=60)
    beat(job, hb(0, 5, at=t0.timestamp()), hb(1, 5, at=t0.timestamp()))
    settle()
    supervision.run_watchdog(at(t0, 1))
    # The broker was down: no pass for 19 s, far past the 5 s deadline.
    assert supervision.run_watchdog(at(t0, 20)).lost == 0
    o = Outage.objects.get(component="watchdog")
    assert (o.started_at, o.ended_at) == (at(t0, 1), at(t0, 20))
    # The deadline moved by the gap (t0 + 5 + 19): the ranks have that long to report again.
    assert passes(t0, 21, 23.5, 0.5) == 0
    assert passes(t0, 24.5, 24.5) == 2 and lost(job) == 2


def test_it_finds_no_lost_rank_while_ingest_is_stopped_longer_than_the_step_timeout(settle):
    job, _ = make_job(spec={"step_timeout_s": 5.0, "procs_per_node": 2})
    t0 = timezone.now() - timedelta(seconds=60)
    beat(job, hb(0, 5, at=t0.timestamp()), hb(1, 5, at=t0.timestamp()))
    settle()
    outages.tick("ingest", at(t0, 1))  # the web's last tick; then it stops
    for s in range(2, 40):  # the watchdog keeps running every second
        assert supervision.run_watchdog(at(t0, s)).lost == 0
    o = Outage.objects.get(component="ingest")
    assert o.started_at == at(t0, 1) and o.ended_at is None
    # Ingest is back; the trainers' spooled beats arrive with their own (old) timestamps.
    outages.tick("ingest", at(t0, 40))
    beat(job, hb(0, 6, at=t0.timestamp() + 30))
    settle()
    assert supervision.run_watchdog(at(t0, 40.5)).lost == 0
    assert Outage.objects.get(component="ingest").ended_at == at(t0, 40.5)
    assert lost(job) == 0
    # Rank 1 sent nothing since t0: its deadline t0 + 5 moved by the 39.5 s outage, no more. (Ingest is
    # back, so it ticks every second: a deadline after its last tick would wait for the next one.)
    assert passes(t0, 41, 44, ingest=True) == 0
    assert passes(t0, 45, 45, ingest=True) == 1
    assert list(Fault.objects.filter(job=job).values_list("rank", flat=True)) == [1]


def test_a_deadline_after_the_last_ingest_tick_waits_for_the_next_tick(settle):
    """Stopped ticks are told from late ones only ``INGEST_STALE_S`` after the last tick: until then,
    a rank whose deadline fell after that tick is not lost (it may have beaten into a stopped web); once
    ingest ticks again, it is (lost-rank detection costs one tick), with either heartbeat store."""
    job, _ = make_job(spec={"step_timeout_s": 5.0, "procs_per_node": 2})
    t0 = timezone.now() - timedelta(seconds=60)
    beat(job, hb(0, 5, at=t0.timestamp()), hb(1, 5, at=t0.timestamp()))
    settle()
    for s in (1, 2, 3, 4, 4.5):  # ingest ticks, the watchdog runs, every rank is in time
        outages.tick("ingest", at(t0, s))
        assert supervision.run_watchdog(at(t0, s)).lost == 0
    # The deadline t0 + 5 passes; no tick since t0 + 4.5 (1.5 s: no outage on record yet).
    assert supervision.run_watchdog(at(t0, 5.5)).lost == 0
    assert supervision.run_watchdog(at(t0, 6)).lost == 0
    assert not Outage.objects.exists()
    # The page shows what the watchdog does: late, not lost.
    rows = list(Rank.objects.filter(job=job))
    assert {f.health for f in readouts.rank_figures(job, rows, at(t0, 6))} == {"late"}
    outages.tick("ingest", at(t0, 6.2))  # ingest was up all along: the ranks did not beat
    assert supervision.run_watchdog(at(t0, 6.5)).lost == 2 and lost(job) == 2
    assert not Outage.objects.exists()


def test_it_finds_no_lost_rank_when_ingest_stops_again_soon_after_an_outage(settle):
    """Flapping ingest: a deadline moved by one outage falls in the next one before that one is on record.
    The deadline that counts is the moved one, not the rank's own."""
    job, _ = make_job(spec={"step_timeout_s": 5.0, "procs_per_node": 1})
    t0 = timezone.now() - timedelta(seconds=60)
    beat(job, hb(0, 5, at=t0.timestamp()))
    settle()
    outages.tick("ingest", at(t0, 1))  # then ingest stops
    assert passes(t0, 2, 19) == 0
    # Back for two seconds (its outage closes at t0 + 20: the deadline moves to t0 + 24), then down again.
    assert passes(t0, 20, 22, 0.5, ingest=True) == 0
    assert Outage.objects.get(component="ingest").ended_at == at(t0, 20)
    # t0 + 24 passes 2 s after the last tick, before the second outage is on record (t0 + 28).
    assert passes(t0, 23, 39) == 0
    assert list(Outage.objects.filter(component="ingest").order_by("started_at")
                .values_list("started_at", "ended_at")) == [(at(t0, 1), at(t0, 20)), (at(t0, 22), None)]
    # Back for good; rank 0 never beat again: its deadline, moved by both outages (19 s + 18 s), is t0 + 42.
    assert passes(t0, 40, 42, ingest=True) == 0
    assert passes(t0, 43, 43, ingest=True) == 1 and lost(job) == 1


def test_it_shows_the_outage_as_a_band_on_the_job_timeline():
    job, _ = make_job(started_at=timezone.now() - timedelta(seconds=120))
    t0 = timezone.now() - timedelta(seconds=60)
    Outage.objects.create(component="ingest", started_at=t0, ended_at=at(t0, 25))
    fig = timeline_part(job, timezone.now())["figure"]
    bands = [s for s in fig["layout"]["shapes"] if s.get("name") == "control plane unavailable"]
    assert len(bands) == 1 and bands[0]["x1"] - bands[0]["x0"] == 25_000
    assert any(t.get("name") == "control plane unavailable" for t in fig["data"])


def test_it_draws_outage_bands_only_inside_the_jobs_own_lifetime():
    now = timezone.now()
    job, _ = make_job(created_at=now - timedelta(seconds=100), started_at=now - timedelta(seconds=100),
                      finished_at=now - timedelta(seconds=20), status="succeeded")
    for a, b in ((-300, -200), (-110, -90), (-60, -50), (-30, -10), (-5, None)):
        Outage.objects.create(component="watchdog", started_at=now + timedelta(seconds=a),
                              ended_at=b and now + timedelta(seconds=b))
    fig = timeline_part(job, now)["figure"]
    bands = [(s["x1"] - s["x0"]) // 1000 for s in fig["layout"].get("shapes", [])
             if s.get("name") == "control plane unavailable"]
    assert bands == [10, 10, 10]  # before it, clipped at its start, inside, clipped at its end; none after
    (labels,) = [t["text"] for t in fig["data"] if t.get("name") == "control plane unavailable"]
    assert labels == ["control plane unavailable"] * 3  # far enough apart


def test_it_labels_only_one_of_two_outage_bands_that_would_run_into_each_other():
    now = timezone.now()
    job, _ = make_job(created_at=now - timedelta(seconds=600), started_at=now - timedelta(seconds=600))
    for a in (-300, -290):
        Outage.objects.create(component="watchdog", started_at=now + timedelta(seconds=a),
                              ended_at=now + timedelta(seconds=a + 6))
    fig = timeline_part(job, now)["figure"]
    (labels,) = [t["text"] for t in fig["data"] if t.get("name") == "control plane unavailable"]
    assert labels == ["control plane unavailable", ""]


def test_a_dependency_outage_is_one_warning_when_it_starts_and_one_when_it_ends(caplog):
    caplog.set_level(logging.WARNING, logger="controlplane.jobs.outages")
    for _ in range(50):
        outages.dependency_failed("redis", ConnectionError("Error 111 connecting to 127.0.0.1:6379"))
    for _ in range(50):
        outages.dependency_ok("redis")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "redis unavailable" in lines[0] and "available again" in lines[1]
    o = Outage.objects.get(component="redis")
    assert o.ended_at is not None and "Error 111" in o.detail


def test_metrics_count_outages_and_say_what_is_degraded(client):
    outages.dependency_failed("broker", "Connection refused")
    text = client.get("/metrics", REMOTE_ADDR="127.0.0.1").content.decode()
    assert 'unbroken_control_plane_outages_total{component="broker"} 1.0' in text
    assert 'unbroken_control_plane_degraded{component="broker"} 1.0' in text
    outages.dependency_ok("broker")
    text = client.get("/metrics", REMOTE_ADDR="127.0.0.1").content.decode()
    assert 'unbroken_control_plane_degraded{component="broker"} 0.0' in text
    assert 'unbroken_control_plane_outages_total{component="broker"} 1.0' in text


def test_the_dashboard_shows_a_banner_while_degraded(admin_client):
    assert "Control plane degraded" not in admin_client.get("/").content.decode()
    Beacon.objects.create(name="watchdog", at=timezone.now() - timedelta(seconds=30))
    page = admin_client.get("/").content.decode()
    assert "Control plane degraded" in page and "watchdog is not running" in page


def test_a_watchdog_pass_closes_a_broker_outage_its_reporter_never_closed():
    Outage.objects.create(component="broker", started_at=timezone.now() - timedelta(seconds=20))
    supervision.run_watchdog()
    assert Outage.objects.get(component="broker").ended_at is not None


def test_it_ignores_a_short_pause_of_the_watchdog():
    t0 = timezone.now() - timedelta(seconds=60)
    supervision.run_watchdog(t0)
    supervision.run_watchdog(at(t0, 1.5))
    assert not Outage.objects.exists()


def test_the_page_and_the_api_show_a_rank_in_outage_grace_as_late_not_lost(settle):
    """What the watchdog will not claim (its deadline moved by the control plane's own outage) is not
    shown as lost either."""
    job, _ = make_job(spec={"step_timeout_s": 5.0, "procs_per_node": 2})
    t0 = timezone.now() - timedelta(seconds=60)
    beat(job, hb(0, 5, at=t0.timestamp()), hb(1, 5, at=t0.timestamp()))
    settle()
    supervision.run_watchdog(at(t0, 1))
    assert supervision.run_watchdog(at(t0, 20)).lost == 0  # no pass for 19 s: an outage of the watchdog
    rows = list(Rank.objects.filter(job=job))
    healths = {f.rank: f.health for f in readouts.rank_figures(job, rows, at(t0, 20))}
    assert healths == {0: "late", 1: "late"}
    # Once the grace is spent, the rank is lost on the page as for the watchdog.
    assert {f.health for f in readouts.rank_figures(job, rows, at(t0, 40))} == {"lost"}
