"""The resilience report page, its link on the job page, and ``manage.py resilience_report``: the same
figures as the API, and a file that holds everything it needs."""

from __future__ import annotations

import json
import re

import pytest
from django.core.management import CommandError, call_command

from tests.controlplane.api import drill
from tests.controlplane.dashboard.factories import make_user

pytestmark = pytest.mark.django_db


@pytest.fixture()
def built(client, post, settle):
    user = make_user("viewer")
    job = drill.build(post, settle, user=user)
    client.force_login(user)
    return job, client


def test_it_links_the_report_from_the_job_page(built):
    job, client = built
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert f'href="/jobs/{job.pk}/report/"' in page
    assert "Check resilience" not in page  # operators only


def test_it_shows_the_apis_figures(built):
    job, client = built
    api = client.get(f"/api/v1/jobs/{job.pk}/report").json()
    resp = client.get(f"/jobs/{job.pk}/report/")
    assert resp.status_code == 200
    html = resp.content.decode()
    for row in api["classes"]:
        assert f'data-class="{row["fault_class"]}"' in html
        for key in row["cycles"]:
            assert key in html
        for fid in row["fault_ids"]:
            assert f'href="/api/v1/jobs/{job.pk}/faults/{fid}"' in html
    share = api["recovery"]["reload_share"]
    assert f"{100 * share:.1f} %" in html
    assert "The Llama 3 Herd of Models" in html and "AWS" in html
    assert re.search(r'<script src="/assets/plotly-[^"]+\.min\.js"', html)


def test_it_writes_a_self_contained_file(built, tmp_path):
    job, client = built
    out = tmp_path / "report.html"
    call_command("resilience_report", str(job.pk), "--out", str(out))
    html = out.read_text()
    assert "<script src" not in html and "<link " not in html  # nothing fetched
    assert "Plotly" in html and len(html) > 1_000_000  # plotly.js inlined
    js = tmp_path / "report.json"
    call_command("resilience_report", str(job.pk), "--out", str(js), "--json", "--gpus", "512")
    data = json.loads(js.read_text())
    api = client.get(f"/api/v1/jobs/{job.pk}/report", {"gpus": 512}).json()
    data.pop("generated_at"), api.pop("generated_at")
    assert data == api


def test_it_names_what_is_wrong_with_the_command(built, tmp_path):
    with pytest.raises(CommandError, match="no job 999"):
        call_command("resilience_report", "999", "--out", str(tmp_path / "x.html"))
    with pytest.raises(CommandError, match="N/DAYS/GPUS"):
        call_command("resilience_report", str(built[0].pk), "--out", str(tmp_path / "x.html"), "--rate", "5")
