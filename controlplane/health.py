"""``/healthz`` for load balancers and Kubernetes probes.

A middleware placed first, so it answers before ALLOWED_HOSTS is checked (probes and ALBs send
the pod IP as Host) and without sessions or CSRF. It checks the database with one ``SELECT 1``.
Under ``manage.py serve`` it adds one line per supervised process with its pid and restart count
(``worker pid=123 alive=1 restarts=2``); probes read only the status code.
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
        except Exception as e:  # any database failure makes the instance unhealthy
            return HttpResponse(f"database unavailable: {type(e).__name__}", status=503, content_type="text/plain")
        return HttpResponse("ok" + supervised_lines(), content_type="text/plain")


def supervised_lines() -> str:
    state = read_state(settings.DATA_DIR)
    if state is None:
        return ""
    return "".join(f"\n{name} pid={c['pid'] or '-'} alive={int(c['alive'])} restarts={c['restarts']}"
                   for name, c in sorted(state["children"].items()))
