"""The timeline's "control plane unavailable" bands: times the control plane could not receive or
evaluate heartbeats (``jobs.outages``: ingest stopped, the watchdog not running). Kept apart from
``recovery_timeline.timeline_figure``: it only adds shapes and one hover trace to a finished figure."""

from __future__ import annotations

from datetime import datetime

from controlplane.dashboard.plots.style import hms, ms, spaced
from controlplane.dashboard.words import fmt_s

BAND_COLOR = "#9e9e9e"
WHAT = {"ingest": "ingest unavailable", "watchdog": "watchdog not running"}


def add_outage_bands(figure: dict, windows: list[dict], now: datetime) -> None:
    """Shade each window over every lane and label it; ``windows`` from ``outages.windows_between``."""
    if not windows:
        return
    layout = figure["layout"]
    xs, texts = [], []
    for w in windows:
        a, b = w["start"].timestamp(), (w["end"] or now).timestamp()
        layout.setdefault("shapes", []).append({
            "type": "rect", "xref": "x", "yref": "paper", "x0": ms(a), "x1": ms(b), "y0": 0, "y1": 1,
            "fillcolor": BAND_COLOR, "opacity": 0.22, "line": {"width": 0}, "layer": "below",
            "name": "control plane unavailable"})
        xs.append(ms((a + b) / 2))
        texts.append(f"<b>control plane unavailable</b> · {WHAT.get(w['component'], w['component'])}<br>"
                     f"{hms(a)} → {'now' if w['end'] is None else hms(b)} UTC ({fmt_s(b - a)})<br>"
                     "not counted against any rank's heartbeat deadline")
    lo, hi = layout.get("xaxis", {}).get("range") or (min(xs), max(xs))
    labels = ["control plane unavailable" if ok else "" for ok in spaced(xs, hi - lo)]
    figure["data"].append({
        "type": "scatter", "mode": "markers+text", "name": "control plane unavailable", "x": xs,
        "y": [0] * len(xs), "text": labels, "textposition": "top center",
        "textfont": {"size": 10, "color": "#616161"}, "marker": {"symbol": "square", "size": 9,
                                                               "color": BAND_COLOR},
        "customdata": texts, "hovertemplate": "%{customdata}<extra></extra>"})
