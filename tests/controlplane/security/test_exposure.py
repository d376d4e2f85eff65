"""What an outsider learns (issue 33): /healthz says ok or not, its details only to a signed-in user or a
client that may read /metrics; /metrics by token or an allowed network, by the connection's address."""

import json
import os

import pytest
from django.contrib.auth.models import User

pytestmark = pytest.mark.django_db


@pytest.fixture()
def serve_state(settings, tmp_path):
    settings.DATA_DIR = tmp_path
    state = {"pid": os.getpid(), "started_at": 0, "children": {
        "worker": {"pid": 4242, "alive": True, "restarts": 1, "started_at": 0, "last_exit": None}}}
    (tmp_path / "serve-state.json").write_text(json.dumps(state))


def test_healthz_tells_an_outsider_only_ok(client, serve_state):
    r = client.get("/healthz", REMOTE_ADDR="203.0.113.9", HTTP_X_FORWARDED_FOR="127.0.0.1")
    assert r.status_code == 200 and r.content == b"ok"


def test_healthz_shows_the_processes_to_a_signed_in_user_and_allowed_scrapers(client, serve_state,
                                                                              monkeypatch):
    assert b"worker pid=4242" in client.get("/healthz", REMOTE_ADDR="127.0.0.1").content  # loopback: allowed
    User.objects.create_user("viewer", password="correct horse battery")
    client.login(username="viewer", password="correct horse battery")
    assert b"worker pid=4242 alive=1 restarts=1" in client.get("/healthz", REMOTE_ADDR="203.0.113.9").content
    client.logout()
    monkeypatch.setenv("UNBROKEN_METRICS_TOKEN", "scrape-token-0123")
    assert client.get("/healthz", REMOTE_ADDR="127.0.0.1").content == b"ok"  # a token is set: it decides
    r = client.get("/healthz", REMOTE_ADDR="203.0.113.9", HTTP_AUTHORIZATION="Bearer scrape-token-0123")
    assert b"worker pid=4242" in r.content


def test_metrics_go_by_the_allowed_networks_not_x_forwarded_for(client, settings):
    assert client.get("/metrics", REMOTE_ADDR="10.1.2.3", HTTP_X_FORWARDED_FOR="127.0.0.1").status_code == 403
    assert client.get("/metrics", REMOTE_ADDR="127.0.0.1", HTTP_X_FORWARDED_FOR="10.1.2.3").status_code == 200
    settings.METRICS_ALLOW_NETWORKS = ["10.1.0.0/16"]
    assert client.get("/metrics", REMOTE_ADDR="10.1.2.3").status_code == 200
    assert client.get("/metrics", REMOTE_ADDR="10.2.0.1").status_code == 403
    assert client.get("/metrics", REMOTE_ADDR="127.0.0.1").status_code == 403  # only what is listed


def test_every_page_carries_the_content_security_policy(client):
    for path in ("/login/", "/api/v1/operator/openapi.json"):
        csp = client.get(path)["Content-Security-Policy"]
        assert "script-src 'self'" in csp and "object-src 'none'" in csp and "frame-ancestors 'none'" in csp
