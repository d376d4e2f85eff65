"""Per-user API tokens for the operator API (``Authorization: Bearer ubk_...``).

A token stands for its user: it reads what the user may read and acts only if the user is an operator.
Only a SHA-256 digest is stored (the token is 256 random bits, so a fast hash is enough and a lookup
is one indexed query); the token itself is shown once, when it is minted, and never again. A revoked
token is kept, with when it was revoked, so the audit trail and the token list stay whole.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import timedelta

from django.conf import settings
from django.db import models
from django.utils import timezone

PREFIX = "ubk_"
# last_used_at is written at most this often per token: a script polling every second is not a write a second.
TOUCH_EVERY = timedelta(minutes=1)


def digest_of(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class ApiTokenQuerySet(models.QuerySet):
    def live(self):
        return self.filter(revoked_at__isnull=True, user__is_active=True)

    def user_for(self, token: str, *, now=None):
        """The active user whose live token this is, or None; notes when it was used."""
        if not token.startswith(PREFIX) or len(token) > 200:
            return None
        row = self.live().select_related("user").filter(digest=digest_of(token)).first()
        if row is None:
            return None
        now = now or timezone.now()
        if row.last_used_at is None or now - row.last_used_at >= TOUCH_EVERY:
            type(row).objects.filter(pk=row.pk).update(last_used_at=now)
        return row.user


class ApiToken(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100)
    # The first characters of the token, shown in lists so its owner can tell tokens apart.
    prefix = models.CharField(max_length=12)
    digest = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(default=timezone.now)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    objects = ApiTokenQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    @classmethod
    def mint(cls, *, user, name: str) -> tuple[ApiToken, str]:
        """A new token for ``user``: the stored row and the token itself (shown once, never stored)."""
        token = PREFIX + secrets.token_urlsafe(32)
        row = cls.objects.create(user=user, name=name[:100] or "token", prefix=token[:12],
                                 digest=digest_of(token))
        return row, token

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None
