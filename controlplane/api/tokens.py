"""Minting and revoking API tokens, each audited (the UI's token page and ``create_api_token`` call these)."""

from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from controlplane.api.models import ApiToken
from controlplane.jobs.services import record_audit


def mint_api_token(*, user, name: str, requested_by, remote_addr: str | None = None) -> tuple[ApiToken, str]:
    """A new token for ``user``; returns the row and the token, which the caller shows once."""
    with transaction.atomic():
        row, token = ApiToken.mint(user=user, name=name)
        record_audit(actor=requested_by, action="api_token.create", remote_addr=remote_addr,
                     detail={"token": row.pk, "name": row.name, "prefix": row.prefix,
                             "user": user.get_username()})
    return row, token


def revoke_api_token(*, token: ApiToken, requested_by, remote_addr: str | None = None) -> bool:
    """Revoke ``token`` (False when it already was); a script sending it gets 401 from now on."""
    with transaction.atomic():
        done = ApiToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())
        if done:
            record_audit(actor=requested_by, action="api_token.revoke", remote_addr=remote_addr,
                         detail={"token": token.pk, "name": token.name, "prefix": token.prefix,
                                 "user": token.user.get_username()})
    return bool(done)
