"""Figures are bounded whatever the job's length (server-side downsampling) and carry their meaning."""

from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.dashboard.parts import checkpoint_part, timeline_part
from controlplane.dashboard.plots import downsample
from controlplane.dashboard.timeline import CHECKPOINT_SAVE, DEAD, HUNG, RESTARTING, TRAINING, Span

from .factories import make_checkpoint, make_cycle, make_fault, make_job, make_rank


def test_it_keeps_few_spans_exact():
    spans = [Span(10.0 * i, 10.0 * i + 1, CHECKPOINT_SAVE, None) for i in range(50)]
    out = downsample.downsample_spans(spans, 0, 1000)
    assert len(out) == 50 and out[3].start == 30.0


def test_it_bins_many_spans_to_a_bounded_count_and_keeps_the_alarming_ones():
    spans = [
        Span(i * 20.0, i * 20.0 + 0.2, CHECKPOINT_SAVE, None) for i in range(5000)
    ]  # 1% of time in saves
    spans.append(Span(50_000.0, 50_003.0, RESTARTING, None, "cycle"))  # 3 s restart in a 100,000 s job
    spans.append(Span(0.0, 100_000.0, TRAINING, None))
    out = downsample.downsample_spans(spans, 0, 100_000, max_spans=400, bins=600)
    assert len(out) <= 601
    assert [s.phase for s in out if s.phase == RESTARTING] == [RESTARTING]
    assert not [s for s in out if s.phase == CHECKPOINT_SAVE]  # 1% saves do not paint the lane
    assert [s for s in out if s.phase == TRAINING][0].end == 100_000.0


def test_it_shows_detail_again_when_zoomed_in():
    spans = [Span(i * 20.0, i * 20.0 + 0.2, CHECKPOINT_SAVE, None) for i in range(5000)]
    out = downsample.downsample_spans(spans, 1000, 1200)  # ten saves in view
    assert len(out) == 11 and all(s.phase == CHECKPOINT_SAVE for s in out)


def test_it_downsamples_checkpoint_points_but_keeps_failures_and_spikes():
    rows = [{"started_at": float(i), "durable_s": 1.0, "state": "durable"} for i in range(5000)]
    rows[1234]["durable_s"] = 99.0
    rows[4321]["state"] = "failed"
    out = downsample.downsample_points(
        rows, key="durable_s", keep=lambda r: r["state"] == "failed", max_points=800
    )
    assert len(out) <= 801
    assert any(r["durable_s"] == 99.0 for r in out)
    assert any(r["state"] == "failed" for r in out)


@pytest.mark.django_db
def test_it_bounds_the_timeline_of_a_long_job():
    now = timezone.now()
    job = make_job(now=now, age_s=3 * 86400, spec={"procs_per_node": 8, "steps": 10**6, "nodes": 1})
    for r in range(8):
        make_rank(job, r, now=now)
    from controlplane.jobs.models import Checkpoint

    start = job.first_step_at
    Checkpoint.objects.bulk_create(
        [
            Checkpoint(
                job=job,
                step=i,
                started_at=start + timedelta(seconds=100 * i),
                blocking_s=0.5,
                finished_at=start + timedelta(seconds=100 * i + 3),
                state="durable",
                mode="async",
            )
            for i in range(1, 2500)
        ]
    )
    for i in range(30):
        at = start + timedelta(hours=2 * i + 1)
        c = make_cycle(job, f"c{i}", fault_at=at)
        make_fault(job, at=at, rank=i % 8, cycle=c, fault_class="hang" if i % 2 else "process_killed")
    fig = timeline_part.timeline_part(job, now, follow=False)["figure"]
    bars = sum(len(t["x"]) for t in fig["data"] if t["type"] == "bar")
    assert bars <= 2 * downsample.MAX_BINS
    names = {t["name"] for t in fig["data"]}
    assert {"training", HUNG, DEAD, "fault · hang", "fault · process_killed", "restart · in-process"} <= names
    assert len(fig["layout"]["shapes"]) >= 30  # cycle bands


@pytest.mark.django_db
def test_it_draws_one_lane_per_rank_grouped_by_node_with_units_and_hover():
    now = timezone.now()
    job = make_job(now=now, spec={"procs_per_node": 4})
    for r, node in enumerate(["b", "a", "b", "a"]):
        make_rank(job, r, now=now, node=node)
    c = make_cycle(job, "a0-ij0-ip1", fault_at=now - timedelta(seconds=100))
    make_fault(job, at=now - timedelta(seconds=100), rank=2, cycle=c)
    make_checkpoint(job, 20, started_at=now - timedelta(seconds=200), blocking_s=1.0)
    tl = timeline_part.timeline_part(job, now, follow=True)
    fig = tl["figure"]
    assert fig["layout"]["yaxis"]["ticktext"] == ["job", "r1 · a", "r3 · a", "r0 · b", "r2 · b"]
    assert fig["layout"]["xaxis"]["title"]["text"] == "time (UTC)"
    cycle = next(t for t in fig["data"] if t["name"] == "restart · in-process")
    hover = cycle["customdata"][0]
    for part in ("detect", "abort", "restart", "reload", "first step", "recovery"):
        assert part in hover
    fault = next(t for t in fig["data"] if t["name"] == "fault · exception")
    assert fault["y"] == [4]  # rank 2 is the 4th lane
    assert tl["follow"] is True and tl["open"]  # the training bar is open: the page extends it live
    t0, t1 = fig["layout"]["xaxis"]["range"]
    assert (t1 - t0) / 1000 <= timeline_part.FOLLOW_WINDOW_S + 5


@pytest.mark.django_db
def test_it_marks_failed_and_sync_saves_on_the_checkpoint_chart():
    now = timezone.now()
    job = make_job(now=now)
    make_checkpoint(job, 20, started_at=now - timedelta(seconds=100), mode="sync", blocking_s=2.0)
    make_checkpoint(job, 40, started_at=now - timedelta(seconds=80), mode="async")
    make_checkpoint(job, 60, started_at=now - timedelta(seconds=60), state="failed", durable_s=5.0)
    make_checkpoint(job, 80, started_at=now - timedelta(seconds=40), state="abandoned", durable_s=None)
    fig = checkpoint_part.checkpoint_part(job)["chart"]["figure"]
    names = {t["name"] for t in fig["data"]}
    assert {
        "blocked · sync",
        "blocked · async",
        "time to durable · sync",
        "time to durable · async",
        "failed",
        "abandoned",
        "write throughput (MB/s)",
    } <= names
    assert fig["layout"]["yaxis"]["type"] == "log"


@pytest.mark.django_db
def test_it_draws_each_async_save_s_interference_and_says_which_mode_costs_the_job_less(client):
    from django.urls import reverse

    from .factories import PASSWORD, make_user

    now = timezone.now()
    job = make_job(now=now)
    for i, step in enumerate((20, 40, 60)):  # async: blocked 0.01 s + 0.5 s of slower steps each
        make_checkpoint(job, step, started_at=now - timedelta(seconds=100 - 10 * i), blocking_s=0.01,
                        interference_s=0.5)
    part = checkpoint_part.checkpoint_part(job)
    slow = next(t for t in part["chart"]["figure"]["data"] if t["name"] == "slower steps · async")
    assert slow["y"] == [0.5, 0.5, 0.5]
    advice = part["advice"]  # no sync save yet: the estimate is the async saves' write time (1.6 s)
    assert (advice.cheaper, advice.sync_measured) == ("async", False)
    assert advice.async_cost_s == pytest.approx(0.51) and advice.sync_s == pytest.approx(1.6)

    # One sync save (the one a stop makes) is not enough to measure: still the estimate.
    make_checkpoint(job, 80, started_at=now - timedelta(seconds=50), mode="sync", blocking_s=0.3)
    job = type(job).objects.get(pk=job.pk)  # a new request (the page caches the rows per job object)
    assert checkpoint_part.checkpoint_part(job)["advice"].sync_measured is False
    for i, step in enumerate((100, 120)):
        make_checkpoint(job, step, started_at=now - timedelta(seconds=40 - 10 * i), mode="sync",
                        blocking_s=0.3)
    job = type(job).objects.get(pk=job.pk)
    advice = checkpoint_part.checkpoint_part(job)["advice"]
    assert (advice.cheaper, advice.sync_measured, advice.sync_s, advice.sync_saves) == ("sync", True, 0.3, 3)
    make_user("viewer")
    client.login(username="viewer", password=PASSWORD)
    body = client.get(reverse("dashboard:job", args=[job.pk])).content.decode()
    assert "Sync saves cost this job less" in body and '"checkpoint_mode": "sync"' in body
    assert "median of 3)" in body
    assert "<th class=\"num\">Slower steps</th>" in body


@pytest.mark.django_db
def test_it_gives_no_advice_before_an_async_save_reported_its_interference():
    now = timezone.now()
    job = make_job(now=now)
    make_checkpoint(job, 20, started_at=now - timedelta(seconds=100))  # an older trainer: no figure
    make_checkpoint(job, 40, started_at=now - timedelta(seconds=80), mode="sync", blocking_s=0.3)
    assert checkpoint_part.checkpoint_part(job)["advice"] is None


@pytest.mark.django_db
def test_it_gives_no_advice_from_fewer_than_three_saves():
    now = timezone.now()
    job = make_job(now=now)
    for i, step in enumerate((20, 40)):
        make_checkpoint(job, step, started_at=now - timedelta(seconds=100 - 10 * i), blocking_s=0.01,
                        interference_s=0.5)
    make_checkpoint(job, 60, started_at=now - timedelta(seconds=50), mode="sync", blocking_s=0.01)
    assert checkpoint_part.checkpoint_part(job)["advice"] is None
