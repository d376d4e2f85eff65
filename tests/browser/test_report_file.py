"""The resilience report's HTML file opens in a browser with no network: every request it makes stays on
this machine (file:// or 127.0.0.1), and its charts are drawn."""

from __future__ import annotations

from urllib.parse import urlparse

import pytest
from django.core.management import call_command

from tests.controlplane.api import drill
from tests.controlplane.conftest import hb_store, post, settle  # noqa: F401 - fixtures
from tests.controlplane.dashboard.factories import make_user

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_the_report_file_opens_with_no_request_leaving_the_machine(
        browser, post, settle, tmp_path, shot):  # noqa: F811 - post and settle: the fixtures imported above
    job = drill.build(post, settle, user=make_user("viewer"))
    out = tmp_path / "report.html"
    call_command("resilience_report", str(job.pk), "--out", str(out))
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    requests, errors = [], []
    page.on("request", lambda r: requests.append(r.url))
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.route("**/*", lambda route: route.continue_() if _local(route.request.url) else route.abort())
    page.goto(out.as_uri())
    page.wait_for_selector("[data-figure][data-drawn='1']", timeout=30_000)
    assert page.locator("[data-figure][data-drawn='1']").count() == page.locator("[data-figure]").count() >= 2
    shot(page, "resilience-report-file")
    assert not errors, errors
    leaving = [u for u in requests if not _local(u)]
    assert not leaving, leaving
    assert page.locator("[data-testid=aws-table] tbody tr").count() == 3


def _local(url: str) -> bool:
    u = urlparse(url)
    return u.scheme in ("file", "data", "blob", "about") or u.hostname in ("127.0.0.1", "localhost")
