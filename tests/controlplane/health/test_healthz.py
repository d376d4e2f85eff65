import pytest


@pytest.mark.django_db
def test_it_answers_ok_for_any_host(client):
    r = client.get("/healthz", HTTP_HOST="10.1.2.3:8000")
    assert r.status_code == 200 and r.content == b"ok"


@pytest.mark.django_db
def test_it_leaves_other_paths_to_allowed_hosts(client):
    r = client.get("/api/v1/jobs", HTTP_HOST="10.1.2.3:8000")
    assert r.status_code == 400


def test_it_reads_back_the_supervised_lines_it_writes():
    from controlplane.healthz import read_supervised

    body = "ok\nbeat pid=- alive=0 restarts=3\nworker pid=123 alive=1 restarts=0"
    assert read_supervised(body) == {"beat": {"pid": "-", "alive": "0", "restarts": "3"},
                                     "worker": {"pid": "123", "alive": "1", "restarts": "0"}}
    assert read_supervised("ok") == {}
