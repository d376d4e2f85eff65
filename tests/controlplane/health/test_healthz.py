import pytest


@pytest.mark.django_db
def test_it_answers_ok_for_any_host(client):
    r = client.get("/healthz", HTTP_HOST="10.1.2.3:8000")
    assert r.status_code == 200 and r.content == b"ok"


@pytest.mark.django_db
def test_it_leaves_other_paths_to_allowed_hosts(client):
    r = client.get("/api/v1/jobs", HTTP_HOST="10.1.2.3:8000")
    assert r.status_code == 400
