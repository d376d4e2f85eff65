"""The goodput bar: one stacked horizontal bar of the shares of the job's wall time."""

from __future__ import annotations

from controlplane.dashboard.plots.style import BASE_LAYOUT

GOODPUT_LABELS = {
    "productive": "productive steps",
    "checkpoint_blocking": "checkpoint blocking",
    "checkpoint_interference": "checkpoint interference (slower steps)",
    "recovery": "recovery",
    "lost_work": "lost work (recomputed steps)",
    "startup": "startup",
    "idle": "idle",
}
GOODPUT_COLORS = {
    "productive": "#59a14f",
    "checkpoint_blocking": "#4e79a7",
    "checkpoint_interference": "#76b7b2",
    "recovery": "#f28e2b",
    "lost_work": "#e15759",
    "startup": "#bab0ac",
    "idle": "#d4d4d4",
}


def goodput_figure(parts: list[dict]) -> dict:
    """``parts``: label, share (of wall time), seconds (formatted) and color, in the order stacked."""
    return {
        "figure": {
            "data": [
                {
                    "type": "bar",
                    "orientation": "h",
                    "name": p["label"],
                    "y": ["wall time"],
                    "x": [round(100 * p["share"], 3)],
                    "marker": {"color": p["color"]},
                    "hovertemplate": f"{p['label']}: %{{x:.1f}}% ({p['seconds']})<extra></extra>",
                }
                for p in parts
            ],
            "layout": {
                **BASE_LAYOUT,
                "barmode": "stack",
                "height": 90,
                "uirevision": "goodput",
                "showlegend": False,
                "xaxis": {"range": [0, 100], "title": {"text": "% of wall time"}, "fixedrange": True},
                "yaxis": {"fixedrange": True, "showticklabels": False},
                "margin": {"l": 10, "r": 10, "t": 5, "b": 40},
            },
        }
    }
