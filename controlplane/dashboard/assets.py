"""plotly.js, served from the installed ``plotly`` package (never a CDN: users run this in closed VPCs).

The URL carries plotly's version, so the response is cacheable for a year. The file is gzipped
once per process when the client accepts it (4.8 MB -> ~1.4 MB).
"""

from __future__ import annotations

import gzip
import threading
from functools import cache
from pathlib import Path

import plotly
from django.http import Http404, HttpResponse
from django.views.decorators.http import require_GET

PLOTLY_VERSION = plotly.__version__
_lock = threading.Lock()


@cache
def _plotly_bytes() -> tuple[bytes, bytes]:
    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    raw = path.read_bytes()
    return raw, gzip.compress(raw, compresslevel=6)


@require_GET
def plotly_js(request, version: str):
    if version != PLOTLY_VERSION:
        raise Http404("stale plotly version; reload the page")
    with _lock:
        raw, packed = _plotly_bytes()
    gz = "gzip" in request.headers.get("Accept-Encoding", "")
    resp = HttpResponse(packed if gz else raw, content_type="text/javascript; charset=utf-8")
    if gz:
        resp["Content-Encoding"] = "gzip"
    resp["Vary"] = "Accept-Encoding"
    resp["Cache-Control"] = "public, max-age=31536000, immutable"
    return resp
