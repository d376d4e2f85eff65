"""What the plots share: the base layout, time on the wire, hover-text escaping, label spacing and the
marker trace."""

from __future__ import annotations

from datetime import UTC, datetime
from functools import partial
from html import escape

BASE_LAYOUT = {
    "margin": {"l": 120, "r": 30, "t": 40, "b": 50},
    "font": {"family": "system-ui, -apple-system, Segoe UI, Roboto, sans-serif", "size": 12},
    "paper_bgcolor": "#ffffff",
    "plot_bgcolor": "#ffffff",
    "hoverlabel": {"align": "left"},
}
# Hover text is plotly's pseudo-HTML (<b>, <br>, <a href>, <span style>): what a job or a person wrote
# (messages, reasons, names) is escaped so it cannot make a link or styled text; plotly shows &lt; as <.
esc = partial(escape, quote=False)


def ms(t: float) -> int:
    return int(round(t * 1000))


def hms(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%H:%M:%S.%f")[:-3]


def markers(name: str, *, x: list, y: list, marker: dict, customdata: list,
            hovertemplate: str = "%{customdata}<extra></extra>", **more) -> dict:
    """A scatter trace of markers whose hover is its ``customdata`` (the HTML each marker explains itself
    with); ``more``: further trace keys (``legendgroup``)."""
    return {"type": "scatter", "mode": "markers", "name": name, **more, "x": x, "y": y, "marker": marker,
            "customdata": customdata, "hovertemplate": hovertemplate}


# Labels on one lane closer than this share of the visible time apart would run into one another
# ("control plane unavailablecontrol plane unavailable"): only the first of them is labelled; the
# others keep their marker and hover.
LABEL_GAP = 0.08


def spaced(xs: list[float], span: float) -> list[bool]:
    """Which of the points at ``xs`` (on one lane) get a text label: left to right, each at least
    ``LABEL_GAP`` of ``span`` after the last labelled one."""
    keep = [False] * len(xs)
    last = None
    for i in sorted(range(len(xs)), key=lambda i: xs[i]):
        if last is None or xs[i] - last >= LABEL_GAP * span:
            keep[i], last = True, xs[i]
    return keep


def right_axis(title: str | None) -> dict:
    """A second y axis on the right, over the first, from zero and without its own grid."""
    return {"title": {"text": title}, "overlaying": "y", "side": "right", "showgrid": False,
            "rangemode": "tozero"}


def time_series_layout(*, uirevision: str, y_title: str, y2_title: str | None, y_from_zero: bool) -> dict:
    """A time axis, a left axis and a right axis that starts at zero (the progress charts); no right
    axis without ``y2_title`` (no series on it)."""
    yaxis: dict = {"title": {"text": y_title}}
    if y_from_zero:
        yaxis["rangemode"] = "tozero"
    layout = {
        **BASE_LAYOUT,
        "height": 280,
        "uirevision": uirevision,
        "xaxis": {"type": "date", "title": {"text": "time (UTC)"}},
        "yaxis": yaxis,
        "yaxis2": right_axis(y2_title),
        "legend": {"orientation": "h", "y": -0.3},
        "margin": {"l": 60, "r": 60, "t": 10, "b": 40},
    }
    if y2_title is None:
        del layout["yaxis2"]
    return layout
