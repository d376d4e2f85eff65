"""The job page in a real browser, from facts written straight into the database (the point is what
the page renders, not training): one fault reads the same in the table and the timeline, a finished
job offers no command and no page offers to send data off the host, the timeline keeps its lane
height and legend through a click on a fault marker at 2, 4 and 64 ranks, and a 10,000-rank job's page
groups its timeline by node, drills down to one node and draws a heartbeat heatmap (screenshots under
test-artifacts/)."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.jobs.spec import DEMO_SPEC
from tests.browser.conftest import ARTIFACTS, POINTS_JS, hover_text
from tests.controlplane.dashboard.factories import (
    make_checkpoint,
    make_cycle,
    make_fault,
    make_fleet_job,
    make_job,
    make_rank,
    node_name,
    populated_job,
    silence,
)

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

GEOMETRY_JS = """() => {
  const gd = document.querySelector('#part-timeline .js-plotly-plot');
  const legend = gd.querySelector('.legend'), plot = gd.querySelector('.nsewdrag');
  const l = legend.getBoundingClientRect(), p = plot.getBoundingClientRect();
  return {plot_h: gd._fullLayout._size.h, legend_bottom: l.bottom, plot_top: p.top, plot_height: p.height};
}"""


def demo_job(now, *, status="running", **kw):
    """The demo job as the issue saw it: an exception (its cycle's layer detected it after 215 ms, the
    fault event was sent after 862 ms) and a SIGKILL, both recovered."""
    job = make_job(now=now, age_s=200, status=status, spec=DEMO_SPEC.to_dict(), last_step=700, **kw)
    for r in range(2):
        make_rank(job, r, now=now, node="vm")
    start = job.first_step_at
    for i in range(8):
        make_checkpoint(job, 20 * (i + 1), started_at=start + timedelta(seconds=20 * i + 5))
    exc_at = start + timedelta(seconds=60)
    c1 = make_cycle(job, "a0-ij0-ip1", fault_at=exc_at, marks=(0.215, 0.3, 0.5, 1.0, 2.32),
                    step_at_fault=300, resumed_from_step=280)
    make_fault(job, at=exc_at, rank=1, cycle=c1, detection_s=0.862, node="", message="drill 300:exception:1")
    kill_at = start + timedelta(seconds=140)
    c2 = make_cycle(job, "a0-ij1", layer="in_job", fault_at=kill_at, marks=(0.167, 0.5, 2.0, 3.0, 4.44),
                    step_at_fault=900, resumed_from_step=880)
    make_fault(job, at=kill_at, rank=0, cycle=c2, fault_class="process_killed", detected_by="launcher",
               detection_s=0.167, node="", message="drill 900:sigkill:0")
    return job


def test_the_demo_page_shows_one_detection_time_in_the_table_and_the_marker(live_server, operator_page, shot):
    page = operator_page
    job = demo_job(timezone.now())
    page.goto(f"{live_server.url}/jobs/{job.pk}/")
    page.wait_for_selector("#part-timeline .main-svg")
    row = page.locator("[data-testid=fault-table] tbody tr").filter(has_text="exception")
    cells = row.locator("td")
    headers = page.locator("[data-testid=fault-table] thead th").all_inner_texts()
    table_detection = cells.nth(headers.index("Detection")).inner_text().strip()
    assert cells.nth(headers.index("Node")).inner_text().strip() == "vm"

    hover = hover_text(page, "fault · exception")
    marker_detection = re.search(r"after ([\d.]+ m?s)", hover).group(1)
    shot(page, "job-page-demo-fault-hover")
    assert table_detection == marker_detection == "215 ms"
    assert cells.nth(headers.index("Recovery")).inner_text().strip() in hover
    assert not page.errors, page.errors


def test_a_finished_job_offers_no_command_and_no_page_offers_to_share(live_server, operator_page, shot):
    page = operator_page
    now = timezone.now()
    job = demo_job(now, status="succeeded", finished_at=now - timedelta(seconds=5))
    page.goto(f"{live_server.url}/jobs/{job.pk}/")
    page.wait_for_selector("#part-timeline .main-svg")
    for testid in ("restart", "inject", "stop"):
        assert page.locator(f"[data-testid={testid}]").count() == 0
    page.locator("[data-testid=start-again]").click()
    page.wait_for_url(f"{live_server.url}/jobs/new/?from={job.pk}")
    assert page.locator("[data-testid=again-from]").is_visible()
    assert page.input_value("#id_steps") == str(DEMO_SPEC.steps)
    shot(page, "job-page-start-again-form")

    for url in (f"/jobs/{job.pk}/", "/", "/jobs/new/"):
        page.goto(f"{live_server.url}{url}")
        page.wait_for_load_state("load")
        charts = page.locator(".js-plotly-plot")
        page.wait_for_timeout(300)
        titles: list[str] = []
        for i in range(charts.count()):
            charts.nth(i).hover()
            titles += page.evaluate(
                "(i) => [...document.querySelectorAll('.js-plotly-plot')[i].querySelectorAll('.modebar-btn')]"
                ".map(b => b.getAttribute('data-title') || '')", i)
        if charts.count():
            assert {"Zoom", "Pan", "Reset axes", "Download plot as a PNG"} <= set(titles), titles
        text = (page.content() + " ".join(titles)).lower()
        for words in ("share chart", "plotly cloud", "chart studio", "send data", "sendchart"):
            assert words not in text, (url, words)
        assert page.locator("[data-title*='Share'], [data-title*='Cloud'], [data-title*='Studio']").count() == 0
    shot(page, "job-page-finished-modebar")
    assert not page.errors, page.errors


@pytest.mark.parametrize("ranks", [2, 4, 64])
def test_the_timeline_keeps_its_lanes_and_legend_after_a_click_on_a_fault(live_server, operator_page, shot,
                                                                          ranks):
    page = operator_page
    page.set_viewport_size({"width": 1600, "height": 1000})
    job = populated_job(timezone.now(), ranks=ranks)
    page.goto(f"{live_server.url}/jobs/{job.pk}/")
    page.wait_for_selector("#part-timeline .main-svg")
    page.wait_for_timeout(1500)
    want = page.evaluate("JSON.parse(document.getElementById('timeline-data').textContent).plot_height")
    before = page.evaluate(GEOMETRY_JS)
    timeline = page.locator("#part-timeline")
    timeline.screenshot(path=str(_artifact(f"timeline-{ranks}-ranks-before.png")))

    for pt in page.evaluate(POINTS_JS, "fault"):
        page.mouse.click(pt["x"], pt["y"])
        page.wait_for_timeout(800)
    page.wait_for_timeout(1500)  # a live refresh and a follow tick
    after = page.evaluate(GEOMETRY_JS)
    timeline.screenshot(path=str(_artifact(f"timeline-{ranks}-ranks-after-fault-click.png")))
    shot(page, f"timeline-{ranks}-ranks-page")

    for g in (before, after):
        assert abs(g["plot_h"] - want) <= 1, (ranks, want, g)  # the lanes keep their height
        assert g["legend_bottom"] <= g["plot_top"] + 1, (ranks, g)  # the legend never covers the lanes
    assert abs(after["plot_height"] - before["plot_height"]) <= 1
    ticks = page.locator("#part-timeline .ytick text").all_text_contents()
    assert "?" not in " ".join(ticks) and len(ticks) == ranks + 1
    assert not page.errors, page.errors


def _artifact(name: str):
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS / name


TICKS_JS = "() => [...document.querySelectorAll('#part-timeline .ytick text')].map(t => t.textContent)"


def test_a_10000_rank_job_groups_its_timeline_by_node_and_drills_down_to_one(live_server, operator_page, shot):
    page = operator_page
    page.set_viewport_size({"width": 1600, "height": 1000})
    now = timezone.now()
    job = make_fleet_job(now, nodes=1250)  # 10,000 ranks
    silence(job, [8 * 7 + 1, 8 * 7 + 2], now)
    at = now - timedelta(seconds=60)
    c = make_cycle(job, "a0-ij0-ip1", fault_at=at)
    make_fault(job, at=at, rank=8 * 40 + 3, cycle=c, fault_class="hang", node=node_name(40))
    page.goto(f"{live_server.url}/jobs/{job.pk}/")
    page.wait_for_selector("#part-timeline .main-svg")
    page.wait_for_selector("[data-testid=rank-heatmap] .main-svg")
    assert page.evaluate(TICKS_JS) == ["job", node_name(7), node_name(40), "1,248 other nodes"]
    assert "rank 323 (node-0040)" in hover_text(page, "fault · hang")
    worst = page.locator("[data-testid=worst-ranks] tbody tr")
    assert worst.nth(0).inner_text().startswith("r57") and "lost" in worst.nth(0).inner_text()
    assert page.locator("[data-testid=rank-heatmap] .hm, [data-testid=rank-heatmap] image").count() >= 1
    shot(page, "job-page-10000-ranks")

    page.locator(f"#part-timeline [data-timeline-node='{node_name(40)}']").click()
    page.wait_for_selector("[data-testid=timeline-node]")
    page.wait_for_function("() => document.querySelectorAll('#part-timeline .ytick text').length === 9")
    assert page.evaluate(TICKS_JS)[4] == f"r323 · {node_name(40)}"
    page.locator("#part-timeline").screenshot(path=str(_artifact("timeline-10000-ranks-node-0040.png")))

    page.locator("[data-testid=timeline-node] [data-timeline-node='']").click()
    page.wait_for_selector("[data-testid=timeline-nodes]")
    page.wait_for_function("() => document.querySelectorAll('#part-timeline .ytick text').length === 4")
    pt = page.evaluate(POINTS_JS, "fault · hang")[0]  # a click on a node lane drills down too
    page.mouse.click(pt["x"], pt["y"])
    page.wait_for_selector("[data-testid=timeline-node]")
    assert node_name(40) in page.locator("[data-testid=timeline-node]").inner_text()
    assert not page.errors, page.errors
