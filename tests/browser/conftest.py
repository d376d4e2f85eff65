"""Browser fixtures: Debian chromium driven by Playwright (sync API). Screenshots go to test-artifacts/."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
# The docs site's pictures (docs/getting-started.md, the README): taken here, so they show the pages as
# they are.
DOCS_IMG = Path(__file__).resolve().parents[2] / "docs" / "img"


@pytest.fixture
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright

    # Playwright's sync API runs an event loop in this thread; the test's own ORM calls are safe here.
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    with sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking"],
        )
        try:
            yield b
        finally:
            b.close()
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)


@pytest.fixture
def shot():
    ARTIFACTS.mkdir(exist_ok=True)

    def _shot(page, name: str) -> None:
        page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)

    return _shot


@pytest.fixture
def docs_shot():
    """Save what the browser shows as ``docs/img/<name>.png``: the viewport (its top ``height`` pixels when
    given), or one element of the page (``selector``)."""

    def _shot(page, name: str, *, selector: str | None = None, height: int | None = None) -> None:
        page.wait_for_timeout(300)  # let plotly finish its transition
        path = str(DOCS_IMG / f"{name}.png")
        if selector:
            page.locator(selector).screenshot(path=path)
        else:
            size = page.viewport_size
            clip = {"x": 0, "y": 0, "width": size["width"], "height": height or size["height"]}
            page.screenshot(path=path, clip=clip)

    return _shot


@pytest.fixture
def operator_page(live_server, browser):
    """A page signed in as an operator (a real account, the real login form); ``page.errors`` collects
    the page's JavaScript errors."""
    from django.contrib.auth.models import Group, User

    from controlplane.jobs.roles import OPERATORS_GROUP

    password = "operator-page-password"
    user = User.objects.create_user("operator", password=password)
    user.groups.add(Group.objects.get_or_create(name=OPERATORS_GROUP)[0])
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.errors = []
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    page.goto(f"{live_server.url}/login/")
    page.fill("#id_username", "operator")
    page.fill("#id_password", password)
    page.click("button[type=submit]")
    page.wait_for_url(f"{live_server.url}/")
    return page


# The pixel position of every point of the traces whose name starts with a prefix, in page coordinates.
POINTS_JS = """(prefix) => {
  const gd = document.querySelector('#part-timeline .js-plotly-plot');
  const box = gd.getBoundingClientRect(), fl = gd._fullLayout, out = [];
  gd._fullData.forEach(function (tr) {
    if (!String(tr.name).startsWith(prefix)) return;
    for (let i = 0; i < tr.x.length; i++) {
      out.push({x: box.left + fl._size.l + fl.xaxis.l2p(fl.xaxis.d2l(tr.x[i])),
                y: box.top + fl._size.t + fl.yaxis.l2p(fl.yaxis.d2l(tr.y[i]))});
    }
  });
  return out;
}"""


def hover_text(page, prefix: str) -> str:
    """The hover label of the one point of the timeline's traces named ``prefix``."""
    pt = page.evaluate(POINTS_JS, prefix)[0]
    page.mouse.move(pt["x"], pt["y"])
    label = page.locator("#part-timeline .hoverlayer .hovertext").first
    label.wait_for(timeout=5000)
    return label.text_content()
