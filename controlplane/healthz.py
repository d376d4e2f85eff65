"""``/healthz`` for load balancers and Kubernetes probes.

A middleware placed first, so it answers before ALLOWED_HOSTS is checked (probes and ALBs send
the pod IP as Host) and without sessions or CSRF. It checks the database with one ``SELECT 1``.
Anyone learns ok (200) or not (503); the details, the database error and under ``manage.py serve`` one line
per supervised process with its pid and restart count (``worker pid=123 alive=1 restarts=2``), only a
signed-in user or a client that may read ``/metrics`` (its token, or an allowed network) sees.
"""

from django.conf import settings
from django.db import connection
from django.http import HttpResponse

from controlplane.supervisor import read_state


class HealthCheckMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if request.path != "/healthz":
            return self.get_response(request)
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1")
        except Exception as e:  # noqa: BLE001 - any database failure makes the instance unhealthy
            detail = f": database unavailable: {type(e).__name__}" if _may_see_details(request) else ""
            return HttpResponse(f"unavailable{detail}", status=503, content_type="text/plain")
        return HttpResponse("ok" + (supervised_lines() if _may_see_details(request) else ""),
                            content_type="text/plain")


def _may_see_details(request) -> bool:
    from django.contrib.auth import get_user
    from django.contrib.sessions.middleware import SessionMiddleware

    from controlplane.dashboard.metrics import scraper_allowed

    if scraper_allowed(request)[0]:
        return True
    if not request.COOKIES.get(settings.SESSION_COOKIE_NAME):
        return False
    try:  # this middleware runs before the session's: read the session for this question only
        SessionMiddleware(lambda r: None).process_request(request)
        return get_user(request).is_authenticated
    except Exception:  # noqa: BLE001 - a broken session store means no details, never a failed probe
        return False


def supervised_lines() -> str:
    state = read_state(settings.DATA_DIR)
    if state is None:
        return ""
    return "".join(f"\n{name} pid={c['pid'] or '-'} alive={int(c['alive'])} restarts={c['restarts']}"
                   for name, c in sorted(state["children"].items()))


def read_supervised(body: str) -> dict[str, dict[str, str]]:
    """The supervised processes in a detailed ``/healthz`` body, by name (``supervised_lines`` read back):
    ``{"worker": {"pid": "123", "alive": "1", "restarts": "2"}}``. Read here, beside the writer, so that the
    serve test and the chaos bench parse the one format the same way."""
    out = {}
    for line in body.splitlines()[1:]:
        name, *kv = line.split()
        out[name] = dict(x.split("=", 1) for x in kv)
    return out
