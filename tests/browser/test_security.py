"""Every page in a real browser under its Content-Security-Policy (issue 33): the header is there, no inline
script or on* handler is on the page, nothing is refused, and a fault message's markup in the timeline's
hover stays text (no link, no styled span)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.jobs.spec import DEMO_SPEC
from tests.browser.conftest import hover_text
from tests.controlplane.dashboard.factories import make_cycle, make_fault, make_job, make_rank

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

MARKUP = '<a href="https://example.com/x">click me</a> <span style="color:red">styled</span>'
INLINE_JS = """() => ({
  inline: [...document.querySelectorAll('script')]
    .filter(s => !s.src && s.type !== 'application/json').length,
  handlers: [...document.querySelectorAll('*')].filter(e => [...e.attributes].some(a => /^on/i.test(a.name)))
    .map(e => e.outerHTML.slice(0, 80)),
  js_links: [...document.querySelectorAll('a[href^="javascript:"]')].length,
})"""


def test_every_page_carries_the_csp_and_no_inline_script(live_server, operator_page):
    now = timezone.now()
    job = make_job(now=now, age_s=120, spec=DEMO_SPEC.to_dict(), last_step=300)
    for r in range(2):
        make_rank(job, r, now=now, node="vm")
    at = job.first_step_at + timedelta(seconds=30)
    cycle = make_cycle(job, "a0-ij0-ip1", fault_at=at, marks=(0.2, 0.3, 0.5, 1.0, 2.0), step_at_fault=100,
                       resumed_from_step=80)
    fault = make_fault(job, at=at, rank=1, cycle=cycle, message=f"boom {MARKUP}")
    page = operator_page
    violations: list[str] = []
    page.on("console", lambda m: violations.append(m.text) if "Content Security Policy" in m.text else None)
    for path in ("/", f"/jobs/{job.pk}/", f"/jobs/{job.pk}/faults/{fault.pk}/", "/jobs/new/"):
        response = page.goto(f"{live_server.url}{path}")
        page.wait_for_load_state("networkidle")
        csp = response.headers.get("content-security-policy", "")
        script_src = csp.split("script-src")[1].split(";")[0]
        assert script_src.strip() == "'self'", csp
        found = page.evaluate(INLINE_JS)
        assert found == {"inline": 0, "handlers": [], "js_links": 0}, (path, found)
    page.goto(f"{live_server.url}/jobs/{job.pk}/")
    page.wait_for_selector("#part-timeline .js-plotly-plot")
    assert "click me" in hover_text(page, "fault · exception")
    assert page.locator("#part-timeline .hoverlayer a").count() == 0
    assert page.locator("#part-timeline .hoverlayer [style*='color:red']").count() == 0
    assert violations == [] and page.errors == [], (violations, page.errors)
    # The login page too, signed out.
    fresh = page.context.browser.new_page()
    response = fresh.goto(f"{live_server.url}/login/")
    assert "script-src 'self'" in response.headers.get("content-security-policy", "")
    assert fresh.evaluate(INLINE_JS)["inline"] == 0
