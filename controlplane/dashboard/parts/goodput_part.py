"""The goodput part: where the job's wall time went, as shares, durations and one stacked bar."""

from __future__ import annotations

from datetime import datetime

from controlplane.dashboard.plots.goodput_bar import GOODPUT_COLORS, GOODPUT_LABELS, goodput_figure
from controlplane.dashboard.words import fmt_s
from controlplane.jobs.goodput import PARTS
from controlplane.jobs.models import Job


def goodput_part(job: Job, now: datetime) -> dict:
    g = job.goodput(now)
    parts = [
        {
            "key": k,
            "label": GOODPUT_LABELS[k],
            "share": g[k],
            "pct": round(100 * g[k], 1),
            "seconds": fmt_s(g[f"{k}_s"]),
            "color": GOODPUT_COLORS[k],
        }
        for k in PARTS
    ]
    fig = goodput_figure(parts)
    return {
        "g": g,
        "parts": parts,
        "wall": fmt_s(g["wall_s"]),
        "goodput_pct": round(100 * g["goodput"], 1),
        "chart": fig,
    }
