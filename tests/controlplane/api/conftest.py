"""The API tests' users: an operator ("op") and a viewer ("viewer"), both with ``logins.PASSWORD``, and
``api``, a GET as the signed-in viewer whose every answer is checked against the served document."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group, User

from controlplane.jobs.roles import OPERATORS_GROUP
from tests.controlplane.api.conformance import conforms
from tests.controlplane.api.logins import DOC, PASSWORD


@pytest.fixture()
def operator():
    user = User.objects.create_user("op", password=PASSWORD)
    user.groups.add(Group.objects.get_or_create(name=OPERATORS_GROUP)[0])
    return user


@pytest.fixture()
def viewer():
    return User.objects.create_user("viewer", password=PASSWORD)


@pytest.fixture()
def api(client, viewer):
    """GET as a signed-in viewer (session); ``api.user`` is that viewer, for building jobs as them."""
    client.force_login(viewer)
    doc = client.get(DOC).json()

    def get(url, want=200, **params):
        r = client.get(url, params)
        assert r.status_code == want, r.content
        conforms(doc, "get", url, r)
        return r.json()

    get.user = viewer
    return get
