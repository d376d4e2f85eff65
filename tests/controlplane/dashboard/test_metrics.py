"""/metrics: Prometheus text format; open on loopback, a bearer token when UNBROKEN_METRICS_TOKEN is set."""

import re

import pytest
from django.utils import timezone

from .factories import PASSWORD, make_user, populated_job

pytestmark = pytest.mark.django_db

SAMPLE = re.compile(
    r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\]|\\.)*",?)*\})? -?[0-9.e+-]+(Inf)?$'
)


def test_it_exposes_the_metrics_in_prometheus_text_format(client):
    job = populated_job(timezone.now())
    resp = client.get("/metrics")
    assert resp.status_code == 200
    assert resp["Content-Type"].startswith("text/plain; version=0.0.4")
    text = resp.content.decode()
    for line in text.splitlines():
        if line.startswith("#"):
            assert line.startswith(("# HELP ", "# TYPE ")), line
        else:
            assert SAMPLE.match(line), line
    j = f'job="{job.pk}"'
    assert f'unbroken_restarts_total{{{j},layer="in_process"}} 1' in text
    assert f'unbroken_faults_total{{{j},class="exception"}} 1' in text
    assert f'unbroken_faults_total{{{j},class="hang"}} 1' in text
    assert "# TYPE unbroken_checkpoint_blocking_seconds histogram" in text
    assert f'unbroken_checkpoint_blocking_seconds_bucket{{{j},le="+Inf"}} 26' in text
    assert f"unbroken_checkpoint_durable_seconds_count{{{j}}} 25" in text
    assert f"unbroken_goodput_ratio{{{j}}} " in text
    assert f'unbroken_rank_heartbeat_age_seconds{{{j},rank="0",node="node-a"}}' in text


def test_it_keeps_histogram_buckets_cumulative(client):
    populated_job(timezone.now())
    text = client.get("/metrics").content.decode()
    counts = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("unbroken_checkpoint_durable_seconds_bucket")
    ]
    assert counts == sorted(counts)


def test_it_refuses_remote_scrapers_without_a_token(client):
    resp = client.get("/metrics", REMOTE_ADDR="10.1.2.3")
    assert resp.status_code == 403
    assert b"UNBROKEN_METRICS_TOKEN" in resp.content


def test_it_lets_signed_in_users_read_from_anywhere(client):
    make_user("viewer")
    client.login(username="viewer", password=PASSWORD)
    assert client.get("/metrics", REMOTE_ADDR="10.1.2.3").status_code == 200


def test_it_requires_the_bearer_token_when_one_is_set(client, monkeypatch):
    monkeypatch.setenv("UNBROKEN_METRICS_TOKEN", "s3cret-token")
    assert client.get("/metrics").status_code == 401  # even on loopback
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    ok = client.get("/metrics", HTTP_AUTHORIZATION="Bearer s3cret-token", REMOTE_ADDR="10.1.2.3")
    assert ok.status_code == 200
