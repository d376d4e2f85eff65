"""The Content-Security-Policy every response carries (docs/guides/security.md).

Scripts come only from this server (``script-src 'self'``): no inline script, no ``on*=`` handler, no
``javascript:`` link runs, so text a job or a person wrote cannot become code even if some escaping
slipped. Data reaches the scripts as non-executable JSON blocks (``json_data``, ``json_script``). Styles may
be inline: plotly draws its charts with style attributes.
"""

from __future__ import annotations

CONTENT_SECURITY_POLICY = "; ".join((
    "default-src 'self'",
    "script-src 'self'",
    "style-src 'self' 'unsafe-inline'",
    "img-src 'self' data:",
    "font-src 'self' data:",
    "connect-src 'self'",
    "object-src 'none'",
    "base-uri 'self'",
    "form-action 'self'",
    "frame-ancestors 'none'",
))


class ContentSecurityPolicyMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        response.setdefault("Content-Security-Policy", CONTENT_SECURITY_POLICY)
        return response
