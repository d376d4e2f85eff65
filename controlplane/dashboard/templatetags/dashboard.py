import orjson
from django import template
from django.utils.html import format_html
from django.utils.safestring import mark_safe

from controlplane.dashboard.words import fmt_s
from controlplane.jobs.roles import is_operator as _is_operator

register = template.Library()


@register.filter
def is_operator(user) -> bool:
    return _is_operator(user)


@register.filter
def seconds(v) -> str:
    return fmt_s(v) if isinstance(v, int | float) else "–"


@register.filter
def epoch(dt) -> str:
    """Unix milliseconds, for the page's age tickers (data-since)."""
    return str(int(dt.timestamp() * 1000)) if dt else ""


@register.filter
def pct(v) -> str:
    return f"{100 * v:.1f}%" if v is not None else "–"


@register.filter
def json_data(value, element_id: str):
    """Like Django's ``json_script`` (a non-executable JSON block, CSP-safe), with orjson and plain
    replaces: Django's ``str.translate`` escaping costs tens of ms on a long job's figures."""
    text = orjson.dumps(value).decode()
    text = text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")
    return format_html('<script id="{}" type="application/json">{}</script>', element_id, mark_safe(text))  # noqa: S308


@register.simple_tag
def degraded_banner() -> str:
    """A banner while the control plane is degraded (an open outage, or a watchdog that stopped)."""
    from django.utils import timezone

    from controlplane.jobs import outages

    try:
        now = timezone.now()
        open_ = outages.open_outages(now)
    except Exception:  # noqa: BLE001 - a page must still render; the database error shows elsewhere
        return ""
    if not open_:
        return ""
    items = "".join(
        format_html("<li><b>{}</b> since {} UTC ({}): {}</li>", o["component"],
                    o["since"].strftime("%H:%M:%S"), fmt_s((now - o["since"]).total_seconds()),
                    o["detail"] or "unavailable")
        for o in open_)
    return format_html(
        '<div class="banner-degraded" role="alert"><b>Control plane degraded.</b> Training continues and '
        "reports are kept by the trainers; time without ingest or the watchdog does not count against any "
        "rank's deadline.<ul>{}</ul></div>", mark_safe(items))  # noqa: S308 - items are format_html output
