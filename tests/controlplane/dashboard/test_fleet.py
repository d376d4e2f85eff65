"""A large job's page (``dashboard/fleet.py``): node lanes with drill-down, a heartbeat heatmap, the worst
ranks first, pages of ranks; nothing that grows with the rank count in the page's markup."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from controlplane.dashboard import fleet
from controlplane.dashboard.parts import rank_table, timeline_part
from controlplane.dashboard.plots import downsample
from controlplane.dashboard.timeline import DEAD, HUNG, RESTARTING, Span
from controlplane.jobs.models import Event, Rank

from .factories import PASSWORD, make_cycle, make_fault, make_fleet_job, make_user, node_name, silence

pytestmark = pytest.mark.django_db


def ticks(fig):
    return fig["layout"]["yaxis"]["ticktext"]


def test_it_keeps_one_lane_per_rank_up_to_the_threshold():
    now = timezone.now()
    job = make_fleet_job(now, nodes=8)  # 64 ranks: the most that still get a lane each
    fig = timeline_part.timeline_part(job, now, follow=False)
    assert fig["mode"] == "ranks" and len(ticks(fig["figure"])) == 65


def test_it_folds_a_large_job_into_node_lanes_with_faults_and_cycle_bands():
    now = timezone.now()
    job = make_fleet_job(now, nodes=128)  # 1,024 ranks
    silence(job, [8 * 7 + 1, 8 * 7 + 2], now)  # two ranks of node 7 stopped beating
    at = now - timedelta(seconds=100)
    c = make_cycle(job, "a0-ij0-ip1", fault_at=at)
    make_fault(job, at=at, rank=8 * 40 + 3, cycle=c, fault_class="hang", node=node_name(40))
    tl = timeline_part.timeline_part(job, now, follow=True)
    fig = tl["figure"]
    assert tl["mode"] == "nodes"
    assert ticks(fig) == ["job", node_name(7), node_name(40), "126 other nodes"]
    dead = next(t for t in fig["data"] if t["name"] == DEAD)
    assert set(dead["y"]) == {1}  # both lost ranks in node 7's lane
    assert any("rank 57 on node-0007" in text for text in dead["customdata"])  # hover: rank and node
    hung = next(t for t in fig["data"] if t["name"] == HUNG)
    assert hung["y"] == [2] and "rank 323 on node-0040" in hung["customdata"][0]
    marker = next(t for t in fig["data"] if t["name"] == "fault · hang")
    assert marker["y"] == [2] and "rank 323 (node-0040)" in marker["customdata"][0]
    assert any(s["type"] == "rect" for s in fig["layout"]["shapes"])  # the restart cycle's band
    assert tl["lane_nodes"] == [None, node_name(7), node_name(40), None]


def test_it_shows_at_most_the_readable_number_of_lanes_the_worst_first():
    now = timezone.now()
    job = make_fleet_job(now, nodes=100)
    at = now - timedelta(seconds=100)
    c = make_cycle(job, "a0-ij0-ip1", fault_at=at)
    for n in range(100):  # an exception on every node: a restarting span per rank
        make_fault(job, at=at, rank=8 * n, cycle=c, node=node_name(n), key=f"f{n}")
    silence(job, [8 * 99 + 5], now)  # and one rank of the last node is dead
    fig = timeline_part.timeline_part(job, now, follow=True)["figure"]
    names = ticks(fig)
    assert len(names) == fleet.MAX_RANK_LANES + 1  # the job lane, 63 nodes, the rest
    assert names[-1] == "37 other nodes"
    assert node_name(99) in names  # dead outranks restarting, whatever the name's order
    restarting = next(t for t in fig["data"] if t["name"] == RESTARTING and any(w < 1 for w in t["width"]))
    assert max(restarting["y"]) == fleet.MAX_RANK_LANES  # the folded nodes' spans are in the last lane


def test_it_drills_down_to_one_nodes_ranks():
    now = timezone.now()
    job = make_fleet_job(now, nodes=128)
    at = now - timedelta(seconds=100)
    c = make_cycle(job, "a0-ij0-ip1", fault_at=at)
    make_fault(job, at=at, rank=8 * 40 + 3, cycle=c, fault_class="hang", node=node_name(40), key="mine")
    make_fault(job, at=at, rank=8 * 41, cycle=c, fault_class="exception", node=node_name(41), key="other")
    tl = timeline_part.timeline_part(job, now, follow=True, node=node_name(40))
    fig = tl["figure"]
    assert tl["mode"] == "node"
    assert ticks(fig) == ["job"] + [f"r{r} · {node_name(40)}" for r in range(320, 328)]
    names = {t["name"] for t in fig["data"]}
    assert "fault · hang" in names and "fault · exception" not in names  # only this node's ranks
    assert next(t for t in fig["data"] if t["name"] == "fault · hang")["y"] == [4]

    make_user("viewer")
    from django.test import Client

    client = Client()
    client.login(username="viewer", password=PASSWORD)
    body = client.get(reverse("dashboard:job_part", args=[job.pk, "timeline"]), {"node": node_name(40)})
    assert body.status_code == 200
    assert b'data-testid="timeline-node"' in body.content
    assert "r327 · node-0040" in body.content.decode()


def test_it_draws_a_heatmap_of_heartbeat_age_by_node_and_local_rank():
    now = timezone.now()
    job = make_fleet_job(now, nodes=600)  # 4,800 ranks: 600 nodes binned 3 to a row
    silence(job, [8 * 301 + 6], now, age_s=90.0)
    Rank.objects.filter(job=job, rank=8 * 599 + 7).update(last_heartbeat_at=None, phase="init", stale_at=None,
                                                         stall_at=None, node="")
    part = rank_table.ranks_part(job, now, {})
    heat = part["heat"]
    trace = heat["chart"]["figure"]["data"][0]
    assert trace["type"] == "heatmap"
    assert (heat["rows"], heat["cols"], heat["nodes_per_row"]) == (200, 8, 3)
    assert len(trace["z"]) == 200 and all(len(row) == 8 for row in trace["z"])
    assert trace["z"][301 // 3][6] >= 89  # the silent rank's cell is its age
    assert trace["z"][0][0] < 5
    assert trace["z"][199][7] is None and "1 never beat" in trace["customdata"][199][7]
    assert "1 lost" in trace["customdata"][100][6] and trace["text"][100][6] == "nodes 300–302"
    assert heat["counts"] == {"ranks": 4800, "lost": 1, "stalled": 0, "never": 1, "stragglers": 0, "ok": 4798}


def test_a_node_of_very_many_ranks_bins_its_local_ranks_into_columns():
    """One node of 1,000 ranks (a simulated fleet's shape): at most MAX_HEAT_COLS columns, not 1,000."""
    now = timezone.now()
    job = make_fleet_job(now, nodes=1, per_node=1000)
    silence(job, [997], now, age_s=90.0)
    heat = rank_table.ranks_part(job, now, {})["heat"]
    trace = heat["chart"]["figure"]["data"][0]
    assert (heat["rows"], heat["cols"], heat["ranks_per_col"]) == (1, 63, 16)  # 16 ranks a column
    assert len(trace["z"][0]) == 63 and trace["z"][0][997 // 16] >= 89
    assert trace["customdata"][0][62].startswith("local ranks 992–999: ") and "1 lost" in trace["customdata"][0][62]
    assert heat["counts"]["ranks"] == 1000 and heat["counts"]["lost"] == 1


def test_it_lists_silent_ranks_then_the_slowest_first():
    now = timezone.now()
    job = make_fleet_job(now, nodes=20)
    silence(job, [17], now, age_s=50.0)
    silence(job, [3], now, age_s=80.0)
    Rank.objects.filter(job=job, rank=9).update(stalled_at=now - timedelta(seconds=5))
    Rank.objects.filter(job=job, rank=100).update(last_heartbeat_at=None, phase="init", stale_at=None,
                                                  stall_at=None)
    Rank.objects.filter(job=job, rank=42).update(busy_s=0.9, straggler_at=now - timedelta(seconds=10))
    Rank.objects.filter(job=job, rank=43).update(busy_s=0.6)
    Event.objects.create(job=job, event_id="s42", kind="straggler", rank=42, at=now - timedelta(seconds=10),
                         source="watchdog", data={"state": "marked", "slowdown_pct": 125.0})
    worst = rank_table.ranks_part(job, now, {})["worst"]
    assert [(r["rank"], r["health"]) for r in worst[:6]] == [
        (3, "lost"), (17, "lost"), (9, "stalled"), (100, "waiting"), (42, "straggler"), (43, "ok")]
    assert worst[4]["slowdown_pct"] == 125.0
    assert len(worst) == 4 + fleet.SLOWEST_SHOWN


def test_it_paginates_every_rank_and_filters_by_node():
    now = timezone.now()
    job = make_fleet_job(now, nodes=20)
    page2 = rank_table.ranks_part(job, now, {"rpage": "2"})
    assert [r["rank"] for r in page2["rows"]] == list(range(25, 50))
    assert page2["page"].paginator.num_pages == 7
    one = rank_table.ranks_part(job, now, {"rnode": node_name(3)})
    assert [r["rank"] for r in one["rows"]] == list(range(24, 32))


def test_the_page_of_a_large_job_has_no_per_rank_markup():
    now = timezone.now()
    job = make_fleet_job(now, nodes=125)  # 1,000 ranks
    make_user("op", operator=True)
    from django.test import Client

    client = Client()
    client.login(username="op", password=PASSWORD)
    body = client.get(reverse("dashboard:job", args=[job.pk])).content.decode()
    assert 'data-testid="rank-heatmap"' in body and 'data-testid="worst-ranks"' in body
    assert 'data-testid="timeline-nodes"' in body
    assert body.count('class="cell health-') < 20  # the legend, not a chip per rank
    assert body.count("<option") < 40  # rank pickers are number fields
    assert 'type="number" name="rank" id="inject-rank"' in body
    assert len(body) < 400_000


def test_binning_many_long_spans_still_picks_the_worst_phase_per_bin():
    spans = [Span(float(i), 1000.0, DEAD if i % 2 else RESTARTING, "other") for i in range(0, 900)]
    out = downsample.downsample_spans(spans, 0, 1000, max_spans=400, bins=100)
    assert {s.phase for s in out} == {DEAD}
    assert out[0].start == pytest.approx(0.0) and out[-1].end == pytest.approx(1000.0)
    few = [Span(0.0, 1000.0, RESTARTING, "l")] * 401 + [Span(500.0, 505.0, DEAD, "l")]
    picked = downsample.downsample_spans(few, 0, 1000, max_spans=400, bins=100)
    assert [(s.phase, s.start) for s in picked if s.phase == DEAD] == [(DEAD, 500.0)]
