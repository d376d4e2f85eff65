"""Per-user API tokens: ``Authorization: Bearer`` on the operator API, minted in the UI and by
``manage.py create_api_token``, stored as a hash, shown once, revocable, audited, carrying the user's role."""

import io
import json

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from controlplane.api.models import ApiToken, digest_of
from controlplane.jobs.models import AuditEntry, Job

pytestmark = pytest.mark.django_db


def _bearer(token):
    return {"HTTP_AUTHORIZATION": f"Bearer {token}"}


def _create(client, token):
    return client.post("/api/v1/jobs", data=json.dumps({"name": "t", "spec": {"steps": 50}}),
                       content_type="application/json", **_bearer(token))


def test_it_lets_an_operator_token_act_without_csrf(client, operator):
    _, token = ApiToken.mint(user=operator, name="ci")
    r = _create(client, token)
    assert r.status_code == 201, r.content
    assert Job.objects.get().created_by == operator
    assert ApiToken.objects.get().last_used_at is not None


def test_it_lets_a_viewer_token_read_but_not_act(client, viewer):
    _, token = ApiToken.mint(user=viewer, name="laptop")
    assert client.get("/api/v1/jobs", **_bearer(token)).status_code == 200
    r = _create(client, token)
    assert r.status_code == 403 and "operators" in r.json()["error"]
    assert Job.objects.count() == 0


@pytest.mark.parametrize("token", ["ubk_not-a-token", "nonsense", "ubk_" + "x" * 500])
def test_it_refuses_an_unknown_token(client, operator, token):
    ApiToken.mint(user=operator, name="real")
    r = client.get("/api/v1/jobs", **_bearer(token))
    assert r.status_code == 401
    assert r["WWW-Authenticate"].startswith("Bearer")
    assert "token was refused" in r.json()["error"]


def test_it_refuses_a_revoked_token_and_an_inactive_users(client, operator, viewer):
    row, token = ApiToken.mint(user=operator, name="old")
    assert client.get("/api/v1/jobs", **_bearer(token)).status_code == 200
    client.force_login(operator)
    client.post(f"/account/tokens/{row.pk}/revoke/")
    client.logout()
    assert client.get("/api/v1/jobs", **_bearer(token)).status_code == 401
    _, other = ApiToken.mint(user=viewer, name="v")
    viewer.is_active = False
    viewer.save()
    assert client.get("/api/v1/jobs", **_bearer(other)).status_code == 401


def test_it_stores_only_a_hash(operator):
    row, token = ApiToken.mint(user=operator, name="x")
    stored = ApiToken.objects.filter(pk=row.pk).values().get()
    assert token not in json.dumps(stored, default=str)
    assert stored["digest"] == digest_of(token) and token.startswith(stored["prefix"])


def test_it_mints_one_with_the_management_command(client, operator):
    out, err = io.StringIO(), io.StringIO()
    call_command("create_api_token", "op", "--name", "ci", stdout=out, stderr=err)
    token = out.getvalue().strip()
    assert token.startswith("ubk_") and "\n" not in token
    assert "shown once" in err.getvalue() and "operator" in err.getvalue()
    assert client.get("/api/v1/jobs", **_bearer(token)).status_code == 200
    assert AuditEntry.objects.filter(action="api_token.create", detail__name="ci").exists()
    with pytest.raises(CommandError, match="no user 'nobody'"):
        call_command("create_api_token", "nobody")


def test_it_shows_a_token_once_in_the_ui_and_lists_only_ones_own(client, operator, viewer):
    ApiToken.mint(user=viewer, name="someone else's")
    client.force_login(operator)
    page = client.post("/account/tokens/", {"name": "laptop"}).content.decode()
    token = page.split('<code class="token">')[1].split("</code>")[0]
    assert client.get("/api/v1/jobs", **_bearer(token)).status_code == 200
    again = client.get("/account/tokens/").content.decode()
    assert token not in again and token[:12] in again and "laptop" in again
    assert "someone else" not in again
    entry = AuditEntry.objects.get(action="api_token.create")
    assert entry.actor == operator and token not in json.dumps(entry.detail)


def test_it_revokes_only_ones_own_token_and_audits_it(client, operator, viewer):
    theirs, _ = ApiToken.mint(user=viewer, name="theirs")
    mine, _ = ApiToken.mint(user=operator, name="mine")
    client.force_login(operator)
    assert client.post(f"/account/tokens/{theirs.pk}/revoke/").status_code == 404
    r = client.post(f"/account/tokens/{mine.pk}/revoke/")
    assert r.status_code == 302
    mine.refresh_from_db()
    theirs.refresh_from_db()
    assert mine.revoked and not theirs.revoked
    assert AuditEntry.objects.filter(action="api_token.revoke", actor=operator,
                                     detail__token=mine.pk).exists()
    assert "revoked" in client.get("/account/tokens/").content.decode()


def test_it_links_the_token_page_from_the_user_menu(client, viewer):
    client.force_login(viewer)
    assert 'href="/account/tokens/"' in client.get("/").content.decode()
    assert "it can read, not act" in client.get("/account/tokens/").content.decode()
