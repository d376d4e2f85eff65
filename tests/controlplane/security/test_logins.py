"""Login throttling (issue 33): 10 wrong passwords lock the account (audited), the right one then waits, on
the form and on the operator API's HTTP Basic; the address is the connection's, not X-Forwarded-For."""

import base64
import os
from io import StringIO

import pytest
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command

from controlplane.jobs.models import AuditEntry

pytestmark = pytest.mark.django_db
PASSWORD = "correct horse battery"


@pytest.fixture(autouse=True)
def fast_hashing(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def _basic(username, password):
    return {"HTTP_AUTHORIZATION": "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()}


def test_it_locks_an_account_after_10_wrong_form_logins_and_audits_it(client):
    User.objects.create_user("op", password=PASSWORD)
    for i in range(10):
        r = client.post("/login/", {"username": "op", "password": f"wrong-{i}"}, REMOTE_ADDR=f"10.0.0.{i}")
        assert r.status_code in (200, 429), r.status_code
    assert r.status_code == 429  # the 10th
    entry = AuditEntry.objects.get(action="login.locked")
    assert entry.detail["username"] == "op" and entry.actor_name == "system"
    # The right password, even from another address, now waits.
    r = client.post("/login/", {"username": "op", "password": PASSWORD}, REMOTE_ADDR="10.9.9.9")
    assert r.status_code == 429 and "try again in 15 minutes" in r.content.decode()
    assert "_auth_user_id" not in client.session


def test_it_locks_http_basic_after_10_wrong_passwords_with_a_json_429(client):
    User.objects.create_user("op", password=PASSWORD)
    for i in range(9):
        assert client.get("/api/v1/jobs", **_basic("op", f"wrong-{i}")).status_code == 401
    r = client.get("/api/v1/jobs", **_basic("op", "wrong-9"))
    assert r.status_code == 429 and r["Content-Type"] == "application/json" and r["Retry-After"] == "900"
    r = client.get("/api/v1/jobs", **_basic("op", PASSWORD))
    assert r.status_code == 429 and "too many wrong passwords" in r.json()["error"]
    assert AuditEntry.objects.filter(action="login.locked").count() == 1


def test_it_locks_an_address_trying_many_accounts(client):
    User.objects.create_user("op", password=PASSWORD)
    for i in range(10):
        client.get("/api/v1/jobs", **_basic(f"guess{i}", "wrong"), REMOTE_ADDR="192.0.2.7")
    r = client.get("/api/v1/jobs", **_basic("op", PASSWORD), REMOTE_ADDR="192.0.2.7")
    assert r.status_code == 429
    # X-Forwarded-For does not choose the address: still locked; another connection is not.
    r = client.get("/api/v1/jobs", **_basic("op", PASSWORD), REMOTE_ADDR="192.0.2.7",
                   HTTP_X_FORWARDED_FOR="203.0.113.1")
    assert r.status_code == 429
    assert client.get("/api/v1/jobs", **_basic("op", PASSWORD), REMOTE_ADDR="192.0.2.8").status_code == 200


def test_it_lets_the_right_password_in_below_the_limit(client):
    User.objects.create_user("op", password=PASSWORD)
    for i in range(9):
        client.get("/api/v1/jobs", **_basic("op", f"wrong-{i}"))
    assert client.get("/api/v1/jobs", **_basic("op", PASSWORD)).status_code == 200
    assert not AuditEntry.objects.filter(action="login.locked").exists()


def test_ensure_operator_refuses_a_password_the_validators_refuse(monkeypatch):
    monkeypatch.setenv("UNBROKEN_OPERATOR_PASSWORD", "short7!")
    with pytest.raises(CommandError, match="at least 10 characters"):
        call_command("ensure_operator", stdout=StringIO())
    assert not User.objects.filter(username="operator").exists()
    monkeypatch.setenv("UNBROKEN_OPERATOR_PASSWORD", "a-long-enough-pass")
    call_command("ensure_operator", stdout=StringIO())
    assert User.objects.get(username="operator").check_password(os.environ["UNBROKEN_OPERATOR_PASSWORD"])
