"""The new-job form in a real browser at 1600 × 900: the Start button within the first screen, the
optional sections collapsed (the Kubernetes one only there for the kubernetes backend), each checkbox
beside its label, the chosen preset not offered again (screenshots under test-artifacts/)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_the_new_job_form_starts_within_the_first_screen(live_server, operator_page, shot):
    page = operator_page
    page.set_viewport_size({"width": 1600, "height": 900})
    page.goto(f"{live_server.url}/jobs/new/?preset=demo")
    start = page.locator("form.jobform button[type=submit]")
    box = start.bounding_box()
    assert box is not None and box["y"] + box["height"] <= 900, box
    shot(page, "form-01-demo")

    assert page.locator("nav.presets a", has_text="Demo").count() == 0  # the chosen one is not a link
    assert page.locator("nav.presets [aria-current=true]").count() == 1
    k8s = page.locator("details[data-show-for-backend=kubernetes]")
    assert not k8s.is_visible()
    closed = page.locator("details.section:not([open])")
    assert closed.count() >= 4 and not page.locator("#id_heartbeat_interval_s").is_visible()
    assert page.locator("#id_drills").is_visible()  # the demo's drills: its section opens

    page.locator("summary", has_text="Resilience layers").click()
    for name in ("in_process", "in_job"):
        box = page.locator(f"#id_{name}").bounding_box()
        label = page.locator(f"label[for=id_{name}]").bounding_box()
        # The checkbox sits inside its label, at its left edge, on the same line.
        assert label["x"] <= box["x"] <= label["x"] + 4 and abs(
            (box["y"] + box["height"] / 2) - (label["y"] + label["height"] / 2)) < 6, (name, box, label)

    page.select_option("#id_backend", "kubernetes")
    assert k8s.is_visible() and k8s.get_attribute("open") is None
    start_box = start.bounding_box()
    assert start_box["y"] + start_box["height"] <= 900
    shot(page, "form-02-kubernetes")
    assert page.errors == []
