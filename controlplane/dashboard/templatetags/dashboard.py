from django import template

from controlplane.dashboard.charts import fmt_s
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
