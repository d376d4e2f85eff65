"""Login throttling for the login form, the admin and the operator API's HTTP Basic (django-axes).

After ``AXES_FAILURE_LIMIT`` (10) wrong passwords for one account, or from one address, that account or
address is locked for ``AXES_COOLOFF_TIME``: even the right password then waits, and a locked attempt is
refused before any password is hashed. The address is the connection's (``REMOTE_ADDR``), never a header a
client can set. Each lockout is an audit entry (``login.locked``). See docs/guides/security.md.
"""

from __future__ import annotations

from axes.backends import AxesStandaloneBackend
from axes.signals import user_locked_out
from django.conf import settings
from django.dispatch import receiver
from django.http import HttpRequest, HttpResponse, JsonResponse


class LoginThrottle(AxesStandaloneBackend):
    """django-axes' check, first among the backends. ``authenticate`` without a request comes from this
    machine's own code (the shell, management commands, a test client's ``login``), not from the network:
    not throttled."""

    def authenticate(self, request: HttpRequest | None, username: str | None = None,
                     password: str | None = None, **kwargs):
        if request is None:
            return None
        return super().authenticate(request, username=username, password=password, **kwargs)


def client_address(request: HttpRequest) -> str | None:
    """The address failures are counted by: the connection's, never X-Forwarded-For."""
    return request.META.get("REMOTE_ADDR")


def locked_out(request: HttpRequest, credentials: dict | None = None, *args, **kwargs) -> HttpResponse:
    """What a locked account or address is answered: JSON for the operator API, a page for the rest."""
    minutes = int(settings.AXES_COOLOFF_TIME.total_seconds() // 60)
    message = (f"too many wrong passwords for this account or from this address: try again in {minutes} "
               "minutes, or ask an administrator (manage.py axes_reset_username <name>)")
    if request.path.startswith("/api/"):
        resp = JsonResponse({"error": message}, status=429)
    else:
        resp = HttpResponse(f"Locked out: {message}.", status=429, content_type="text/plain; charset=utf-8")
    resp["Retry-After"] = str(int(settings.AXES_COOLOFF_TIME.total_seconds()))
    return resp


@receiver(user_locked_out)
def _audit_lockout(sender, request: HttpRequest, username: str | None, ip_address: str | None,
                   **kwargs) -> None:
    """One audit entry per lockout (axes signals again for each attempt while locked)."""
    from django.utils import timezone

    from controlplane.jobs.models import AuditEntry
    from controlplane.jobs.services import record_audit

    detail = {"username": (username or "")[:150], "address": ip_address or ""}
    since = timezone.now() - settings.AXES_COOLOFF_TIME
    seen = AuditEntry.objects.filter(action="login.locked", at__gte=since,
                                     detail__username=detail["username"], detail__address=detail["address"])
    if not seen.exists():
        record_audit(actor=None, action="login.locked", detail=detail, remote_addr=ip_address)
