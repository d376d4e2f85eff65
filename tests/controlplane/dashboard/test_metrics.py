"""/metrics: Prometheus text format; open on loopback, a bearer token when UNBROKEN_METRICS_TOKEN is set."""

import re
from datetime import timedelta

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
    assert f'unbroken_restarts_total{{{j},layer="in_process"}} 1.0' in text
    assert f'unbroken_faults_total{{class="exception",{j}}} 1.0' in text
    assert f'unbroken_faults_total{{class="hang",{j}}} 1.0' in text
    assert "# TYPE unbroken_checkpoint_blocking_seconds histogram" in text
    assert f'unbroken_checkpoint_blocking_seconds_bucket{{{j},le="+Inf"}} 26.0' in text
    assert f"unbroken_checkpoint_durable_seconds_count{{{j}}} 25.0" in text
    assert f"unbroken_goodput_ratio{{{j}}} " in text
    assert f"unbroken_job_step{{{j}}} {float(job.last_step)}" in text
    assert f'unbroken_rank_heartbeat_age_seconds_bucket{{{j},le="+Inf"}} ' in text
    assert f"unbroken_rank_heartbeat_age_max_seconds{{{j}}} " in text
    assert "status=" not in text and "name=" not in text and "rank=" not in text  # bounded labels only


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


def series(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def _ranks(job, n: int, now) -> None:
    from controlplane.jobs.models import Rank

    Rank.objects.bulk_create([Rank(job=job, rank=r, node=f"node-{r // 8}", phase="train", last_step=10,
                                   last_heartbeat_at=now - timedelta(seconds=r % 700), step_time_s=0.1)
                              for r in range(2, n)], batch_size=5000)  # populated_job made ranks 0 and 1


def test_a_job_with_10000_ranks_makes_as_many_series_as_one_with_2(client, django_assert_max_num_queries):
    now = timezone.now()
    small = populated_job(now)
    before = len(series(client.get("/metrics").content.decode()))
    big = populated_job(now)
    _ranks(big, 10_000, now)
    with django_assert_max_num_queries(40):  # grouped queries: none per rank, checkpoint or job part
        text = client.get("/metrics").content.decode()
    per_job = {j: [line for line in series(text) if f'job="{j}"' in line] for j in (small.pk, big.pk)}
    assert len(per_job[big.pk]) == len(per_job[small.pk]) <= 120
    assert len(series(text)) == 2 * before
    b = f'job="{big.pk}"'
    assert f'unbroken_rank_heartbeat_age_seconds_count{{{b}}} 10000.0' in text
    assert f'unbroken_rank_heartbeat_age_seconds_bucket{{{b},le="60.0"}} ' in text
    assert float(text.split(f"unbroken_rank_heartbeat_age_max_seconds{{{b}}} ")[1].split()[0]) >= 699
