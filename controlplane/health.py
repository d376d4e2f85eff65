"""``/healthz`` for load balancers and Kubernetes probes.

A middleware placed first, so it answers before ALLOWED_HOSTS is checked (probes and ALBs send
the pod IP as Host) and without sessions or CSRF. It checks the database with one ``SELECT 1``.
"""

from django.db import connection
from django.http import HttpResponse


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
        return HttpResponse("ok", content_type="text/plain")
