"""Plotly figure dicts, built and downsampled on the server (the page only renders them).

Every builder returns plain JSON-able dicts. Times on the wire are unix milliseconds (plotly reads
them as UTC on a date axis); durations are seconds in labels and milliseconds as bar lengths.
Downsampling keeps each figure to a bounded number of marks whatever the job's length:
``MAX_SPANS`` bars per lane on the timeline, ``MAX_POINTS`` checkpoint points.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime

from controlplane.dashboard.timeline import (
    CHECKPOINT_LOAD,
    CHECKPOINT_SAVE,
    DEAD,
    HUNG,
    PHASES,
    RESTARTING,
    STARTING,
    TRAINING,
    Span,
)

MAX_SPANS = 400  # per lane (job-wide counts as one lane)
MAX_BINS = 600
MAX_POINTS = 600
MAX_FAULT_MARKERS = 500
MAX_LABELLED = 25

PHASE_COLORS = {
    TRAINING: "#9ad0a6",
    STARTING: "#c9c9c9",
    CHECKPOINT_SAVE: "#4e79a7",
    CHECKPOINT_LOAD: "#b07aa1",
    RESTARTING: "#f28e2b",
    HUNG: "#edc948",
    DEAD: "#c0392b",
}
# When a bin holds several phases, the most alarming wins; a save must cover a quarter of the bin.
PRIORITY = (DEAD, HUNG, RESTARTING, CHECKPOINT_LOAD, STARTING, CHECKPOINT_SAVE)
MIN_COVER = {CHECKPOINT_SAVE: 0.25}
LAYER_COLORS = {"in_process": "#59a14f", "in_job": "#f28e2b", "job": "#e15759", "none": "#7f7f7f"}
LAYER_NAMES = {"in_process": "in-process", "in_job": "in-job", "job": "whole job", "none": "none (stopped)"}
FAULT_COLORS = {
    "exception": "#d62728",
    "hang": "#bcbd22",
    "process_killed": "#8c564b",
    "nan_loss": "#e377c2",
    "heartbeat_lost": "#7f7f7f",
    "stalled": "#17becf",
    "node_lost": "#1f1f1f",
    "oom_killed": "#9467bd",
    "evicted": "#ff7f0e",
    "unschedulable": "#aec7e8",
    "image_pull": "#98df8a",
}
BASE_LAYOUT = {
    "margin": {"l": 120, "r": 30, "t": 40, "b": 50},
    "font": {"family": "system-ui, -apple-system, Segoe UI, Roboto, sans-serif", "size": 12},
    "paper_bgcolor": "#ffffff",
    "plot_bgcolor": "#ffffff",
    "hoverlabel": {"align": "left"},
}


def ms(t: float) -> int:
    return int(round(t * 1000))


def hms(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%H:%M:%S.%f")[:-3]


def fmt_s(v: float | None) -> str:
    if v is None:
        return "–"
    if v < 1:
        return f"{v * 1000:.0f} ms"
    if v < 120:
        return f"{v:.2f} s"
    if v < 7200:
        return f"{v / 60:.1f} min"
    return f"{v / 3600:.1f} h"


# -- downsampling ------------------------------------------------------------------------------------


def downsample_spans(
    spans: list[Span], t0: float, t1: float, *, max_spans: int = MAX_SPANS, bins: int = MAX_BINS
) -> list[Span]:
    """Clip spans to [t0, t1]; a lane with more than ``max_spans`` overlay spans is binned.

    Training is the background and is never binned. In a binned lane each bin shows the most
    alarming phase present (a save must fill a quarter of the bin to show), and runs of equal bins
    become one span labelled with the resolution, so zooming in (a narrower window) shows detail.
    """
    out: list[Span] = []
    lanes: dict[int | None, list[Span]] = defaultdict(list)
    for s in spans:
        if s.end < t0 or s.start > t1:
            continue
        c = Span(max(s.start, t0), min(s.end, t1), s.phase, s.lane, s.label, s.open)
        if c.phase == TRAINING:
            out.append(c)
        else:
            lanes[c.lane].append(c)
    width = (t1 - t0) / bins if t1 > t0 else 0.0
    for lane, items in lanes.items():
        if len(items) <= max_spans or width <= 0:
            out.extend(items)
            continue
        cover: dict[str, list[float]] = defaultdict(lambda: [0.0] * bins)
        open_phases: set[str] = set()
        for s in items:
            if s.open:
                open_phases.add(s.phase)
            i0 = min(bins - 1, int((s.start - t0) / width))
            i1 = min(bins - 1, int((s.end - t0) / width))
            row = cover[s.phase]
            for i in range(i0, i1 + 1):
                a = max(s.start, t0 + i * width)
                b = min(s.end, t0 + (i + 1) * width)
                row[i] += max(b - a, 1e-9)
        chosen: list[str | None] = []
        for i in range(bins):
            pick = None
            for phase in PRIORITY:
                row = cover.get(phase)
                if row and row[i] > 0 and row[i] >= MIN_COVER.get(phase, 0.0) * width:
                    pick = phase
                    break
            chosen.append(pick)
        i = 0
        while i < bins:
            if chosen[i] is None:
                i += 1
                continue
            j = i
            while j + 1 < bins and chosen[j + 1] == chosen[i]:
                j += 1
            phase = chosen[i]
            a, b = t0 + i * width, t0 + (j + 1) * width
            out.append(
                Span(
                    a,
                    b,
                    phase,
                    lane,
                    f"{phase} (summary at {fmt_s(width)} resolution: zoom in for detail)",
                    open=phase in open_phases and j == bins - 1,
                )
            )
            i = j + 1
    return out


def downsample_points(rows: list[dict], *, key: str, keep, max_points: int = MAX_POINTS) -> list[dict]:
    """Keep at most ~``max_points`` rows: every row for which ``keep(row)`` is true (rare: failures),
    and per time bucket the rows with the largest ``key`` values (the spikes an operator looks for)."""
    if len(rows) <= max_points:
        return rows
    special = [r for r in rows if keep(r)]
    rest = [r for r in rows if not keep(r)]
    buckets = max(1, (max_points - len(special)) // 2)
    size = len(rest) / buckets
    picked = []
    for b in range(buckets):
        chunk = rest[int(b * size) : int((b + 1) * size)]
        if not chunk:
            continue
        top = max(chunk, key=lambda r: r[key] or 0.0)
        low = min(chunk, key=lambda r: r[key] or 0.0)
        picked.append(low)
        if top is not low:
            picked.append(top)
    merged = sorted(special + picked, key=lambda r: r["started_at"])
    return merged


# -- recovery timeline ----------------------------------------------------------------------------


def timeline_figure(
    *,
    lanes: list[dict],
    spans: list[Span],
    faults: list[dict],
    cycles: list[dict],
    commands: list[dict],
    t0: float,
    t1: float,
    now: float,
) -> dict:
    """Lanes: the job lane (y=0: cycles, commands, rank-less faults) then one per rank, grouped by node.

    Returns ``{"figure": ..., "open": [[trace, point], ...], "now_ms": ...}``; the page extends the
    open bars to the present while it follows live.
    """
    n = len(lanes)
    lane_y = {ln["rank"]: i + 1 for i, ln in enumerate(lanes)}
    traces: list[dict] = []
    open_points: list[list[int]] = []
    spans = downsample_spans(spans, t0, t1)
    by_phase: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        by_phase[s.phase].append(s)
    for phase in PHASES:
        items = by_phase.get(phase)
        if not items:
            continue
        y, base, length, width, text = [], [], [], [], []
        for k, s in enumerate(items):
            if s.lane is None:
                y.append((n + 1) / 2)
                width.append(max(n, 1))
                who = "all ranks"
            else:
                y.append(lane_y.get(s.lane, 0))
                width.append(0.8)
                who = f"rank {s.lane}"
            base.append(ms(s.start))
            length.append(max(1, ms(s.end) - ms(s.start)))
            dur = "running" if s.open else fmt_s(s.end - s.start)
            text.append(
                f"<b>{phase}</b> · {who}<br>{s.label}<br>{hms(s.start)} → "
                f"{'now' if s.open else hms(s.end)} UTC ({dur})"
            )
            if s.open:
                open_points.append([len(traces), k])
        traces.append(
            {
                "type": "bar",
                "orientation": "h",
                "name": phase,
                "legendgroup": "phase",
                "y": y,
                "base": base,
                "x": length,
                "width": width,
                "marker": {"color": PHASE_COLORS[phase], "line": {"width": 0}},
                "customdata": text,
                "hovertemplate": "%{customdata}<extra></extra>",
            }
        )

    shapes: list[dict] = []
    by_layer: dict[str, list[dict]] = defaultdict(list)
    for c in cycles:
        start = c["start"]
        if start is None or start > t1 or (c["first_step_at"] or now) < t0:
            continue
        by_layer[c["layer"]].append(c)
        shapes.append(
            {
                "type": "rect",
                "xref": "x",
                "yref": "paper",
                "x0": ms(start),
                "x1": ms(c["first_step_at"] or now),
                "y0": 0,
                "y1": 1,
                "fillcolor": LAYER_COLORS.get(c["layer"], "#7f7f7f"),
                "opacity": 0.18,
                "line": {"width": 1, "color": LAYER_COLORS.get(c["layer"], "#7f7f7f")},
                "layer": "above",
            }
        )
    labelled = sum(len(v) for v in by_layer.values()) <= MAX_LABELLED
    for layer, items in by_layer.items():
        d = [c["durations"] for c in items]
        traces.append(
            {
                "type": "scatter",
                "mode": "markers+text" if labelled else "markers",
                "name": f"restart · {LAYER_NAMES.get(layer, layer)}",
                "legendgroup": "cycle",
                "x": [ms(c["start"]) for c in items],
                "y": [0] * len(items),
                "text": [f"{LAYER_NAMES.get(layer, layer)} {fmt_s(c['recovery_s'])}" for c in items],
                "textposition": "middle right",
                "textfont": {"size": 10},
                "marker": {"symbol": "diamond", "size": 11, "color": LAYER_COLORS.get(layer, "#7f7f7f")},
                "customdata": [
                    f"<b>restart cycle {c['key']}</b> · layer {LAYER_NAMES.get(layer, layer)}"
                    f"{'<br>' + c['reason'] if c['reason'] else ''}<br>"
                    + " · ".join(f"{k.replace('_', ' ')} {fmt_s(v)}" for k, v in dd.items())
                    + f"<br>recovery {fmt_s(c['recovery_s']) if c['first_step_at'] else 'in progress'}"
                    + (f" · steps lost {c['lost_steps']}" if c["lost_steps"] is not None else "")
                    for c, dd in zip(items, d, strict=True)
                ],
                "hovertemplate": "%{customdata}<extra></extra>",
            }
        )

    visible = [f for f in faults if t0 <= f["at"] <= t1][-MAX_FAULT_MARKERS:]
    by_class: dict[str, list[dict]] = defaultdict(list)
    for f in visible:
        by_class[f["fault_class"]].append(f)
    labelled = len(visible) <= MAX_LABELLED
    for cls, items in sorted(by_class.items()):
        traces.append(
            {
                "type": "scatter",
                "mode": "markers+text" if labelled else "markers",
                "name": f"fault · {cls}",
                "legendgroup": "fault",
                "x": [ms(f["at"]) for f in items],
                "y": [lane_y.get(f["rank"], 0) for f in items],
                "text": [cls] * len(items) if labelled else None,
                "textposition": "top center",
                "textfont": {"size": 10, "color": FAULT_COLORS.get(cls, "#000")},
                "marker": {
                    "symbol": "x",
                    "size": 12,
                    "color": FAULT_COLORS.get(cls, "#000"),
                    "line": {"width": 1, "color": "#000"},
                },
                "customdata": [
                    f"<b>fault: {cls}</b> · rank {f['rank'] if f['rank'] is not None else '–'}"
                    f"{' (' + f['node'] + ')' if f['node'] else ''}<br>at {hms(f['at'])} UTC · detected by "
                    f"{f['detected_by']} after {fmt_s(f['detection_s'])}<br>{(f['message'] or '')[:160]}"
                    for f in items
                ],
                "hovertemplate": "%{customdata}<extra></extra>",
            }
        )
        if not labelled:
            del traces[-1]["text"]

    cmds = [c for c in commands if t0 <= c["issued_at"] <= t1]
    if cmds:
        traces.append(
            {
                "type": "scatter",
                "mode": "markers",
                "name": "operator command",
                "legendgroup": "command",
                "x": [ms(c["issued_at"]) for c in cmds],
                "y": [0] * len(cmds),
                "marker": {"symbol": "triangle-down", "size": 11, "color": "#333"},
                "customdata": [f"<b>{c['summary']}</b><br>by {c['by']} · {c['status']}" for c in cmds],
                "hovertemplate": "%{customdata}<extra></extra>",
            }
        )

    # Node groups: a line between nodes, the node in each rank's tick label.
    prev = None
    for i, ln in enumerate(lanes):
        if prev is not None and ln["node"] != prev:
            shapes.append(
                {
                    "type": "line",
                    "xref": "paper",
                    "yref": "y",
                    "x0": 0,
                    "x1": 1,
                    "y0": i + 0.5,
                    "y1": i + 0.5,
                    "line": {"color": "#555", "width": 1, "dash": "dot"},
                }
            )
        prev = ln["node"]
    ticktext = ["job"] + [f"r{ln['rank']} · {ln['node'] or '?'}" for ln in lanes]
    layout = {
        **BASE_LAYOUT,
        "height": min(1150, 210 + 18 * (n + 1)),
        "barmode": "overlay",
        "bargap": 0,
        "dragmode": "zoom",
        "uirevision": "timeline",
        "showlegend": True,
        "legend": {"orientation": "h", "x": 0, "y": 1.0, "yanchor": "bottom", "font": {"size": 11}},
        "xaxis": {
            "type": "date",
            "range": [ms(t0), ms(t1)],
            "title": {"text": "time (UTC)"},
            "showgrid": True,
            "gridcolor": "#eee",
        },
        "yaxis": {
            "tickvals": list(range(n + 1)),
            "ticktext": ticktext,
            "autorange": "reversed",
            "fixedrange": True,
            "tickfont": {"size": 10 if n > 16 else 11},
            "range": [n + 0.6, -0.6],
        },
        "shapes": shapes,
        "margin": {"l": 130, "r": 20, "t": 60, "b": 40},
    }
    return {"figure": {"data": traces, "layout": layout}, "open": open_points, "now_ms": ms(now)}


# -- checkpoints --------------------------------------------------------------------------------------


def checkpoint_figure(rows: list[dict]) -> dict:
    """Per save: blocked time and time to durable (log seconds), write throughput (MB/s, right axis).

    ``rows``: started_at, step, mode, state, blocking_s, durable_s (or None), elapsed_s, mb_per_s.
    """
    total = len(rows)
    rows = downsample_points(rows, key="durable_s", keep=lambda r: r["state"] in ("failed", "abandoned"))
    traces = []

    # Hover from numbers (customdata + hovertemplate): a preformatted string per point would triple the
    # payload of a long job's chart.
    def custom(sel: list[dict]) -> list[list]:
        return [
            [
                r["step"],
                r["state"],
                r["blocking_s"],
                r["durable_s"],
                r["mb_per_s"] and round(r["mb_per_s"], 1),
            ]
            for r in sel
        ]

    def template(mode: str) -> str:
        return (
            f"<b>step %{{customdata[0]}}</b> · {mode} · %{{customdata[1]}}<br>started %{{x|%H:%M:%S}} UTC"
            "<br>loop blocked %{customdata[2]:.3f} s · durable after %{customdata[3]:.2f} s"
            "<br>write %{customdata[4]} MB/s<extra></extra>"
        )

    for mode, symbol in (("sync", "square"), ("async", "circle")):
        sel = [r for r in rows if r["mode"] == mode and r["state"] in ("durable", "in_flight")]
        if not sel:
            continue
        traces.append(
            {
                "type": "scatter",
                "mode": "markers",
                "name": f"blocked · {mode}",
                "x": [ms(r["started_at"]) for r in sel],
                "y": [r["blocking_s"] for r in sel],
                "marker": {"symbol": symbol, "size": 7, "color": "#4e79a7"},
                "customdata": custom(sel),
                "hovertemplate": template(mode),
            }
        )
        dur = [r for r in sel if r["durable_s"] is not None]
        if dur:
            traces.append(
                {
                    "type": "scatter",
                    "mode": "markers",
                    "name": f"time to durable · {mode}",
                    "x": [ms(r["started_at"]) for r in dur],
                    "y": [r["durable_s"] for r in dur],
                    "marker": {
                        "symbol": symbol + "-open",
                        "size": 8,
                        "color": "#59a14f",
                        "line": {"width": 2},
                    },
                    "customdata": custom(dur),
                    "hovertemplate": template(mode),
                }
            )
    for state, color in (("failed", "#c0392b"), ("abandoned", "#ff7f0e")):
        sel = [r for r in rows if r["state"] == state]
        if sel:
            traces.append(
                {
                    "type": "scatter",
                    "mode": "markers",
                    "name": state,
                    "x": [ms(r["started_at"]) for r in sel],
                    "y": [r["elapsed_s"] or r["blocking_s"] or 0.001 for r in sel],
                    "marker": {"symbol": "x", "size": 11, "color": color},
                    "customdata": custom(sel),
                    "hovertemplate": template("save"),
                }
            )
    thr = [r for r in rows if r["mb_per_s"]]
    if thr:
        traces.append(
            {
                "type": "scatter",
                "mode": "lines",
                "name": "write throughput (MB/s)",
                "yaxis": "y2",
                "x": [ms(r["started_at"]) for r in thr],
                "y": [round(r["mb_per_s"], 2) for r in thr],
                "line": {"color": "#bab0ac", "width": 1},
                "hovertemplate": "%{y:.1f} MB/s<extra></extra>",
            }
        )
    note = f"{total} saves" + (f", {len(rows)} shown (spikes and failures kept)" if len(rows) < total else "")
    layout = {
        **BASE_LAYOUT,
        "height": 320,
        "uirevision": "ckpt",
        "title": {"text": note, "font": {"size": 12}, "x": 0.01},
        "xaxis": {"type": "date", "title": {"text": "save started (UTC)"}},
        "yaxis": {"type": "log", "dtick": 1, "title": {"text": "seconds (log scale)"}},
        "yaxis2": {
            "title": {"text": "MB/s"},
            "overlaying": "y",
            "side": "right",
            "showgrid": False,
            "rangemode": "tozero",
        },
        "legend": {"orientation": "h", "y": -0.25},
        "margin": {"l": 60, "r": 60, "t": 30, "b": 40},
    }
    return {"figure": {"data": traces, "layout": layout}}


# -- progress: steps, throughput, loss -----------------------------------------------------------


def progress_figure(points: list[tuple[float, int]]) -> dict:
    """Step over time with steps/s between samples (right axis). ``points``: (unix s, step), sorted."""
    if len(points) > MAX_POINTS:
        stride = len(points) / MAX_POINTS
        points = [points[int(i * stride)] for i in range(MAX_POINTS)] + [points[-1]]
    rate_x, rate_y = [], []
    for (ta, sa), (tb, sb) in zip(points, points[1:], strict=False):
        if tb > ta and sb >= sa:
            rate_x.append(ms(tb))
            rate_y.append(round((sb - sa) / (tb - ta), 3))
    traces = [
        {
            "type": "scatter",
            "mode": "lines+markers",
            "name": "step",
            "x": [ms(t) for t, _ in points],
            "y": [s for _, s in points],
            "line": {"color": "#4e79a7"},
            "marker": {"size": 4},
            "hovertemplate": "step %{y}<br>%{x}<extra></extra>",
        },
        {
            "type": "scatter",
            "mode": "lines",
            "name": "throughput (steps/s)",
            "x": rate_x,
            "y": rate_y,
            "yaxis": "y2",
            "line": {"color": "#f28e2b", "shape": "hv"},
            "hovertemplate": "%{y:.2f} steps/s<extra></extra>",
        },
    ]
    layout = _time_series_layout(uirevision="progress", y_title="step", y2_title="steps/s", y_from_zero=True)
    return {"figure": {"data": traces, "layout": layout}}


def _time_series_layout(*, uirevision: str, y_title: str, y2_title: str, y_from_zero: bool) -> dict:
    """A time axis, a left axis and a right axis that starts at zero (the progress charts)."""
    yaxis: dict = {"title": {"text": y_title}}
    if y_from_zero:
        yaxis["rangemode"] = "tozero"
    return {
        **BASE_LAYOUT,
        "height": 280,
        "uirevision": uirevision,
        "xaxis": {"type": "date", "title": {"text": "time (UTC)"}},
        "yaxis": yaxis,
        "yaxis2": {
            "title": {"text": y2_title},
            "overlaying": "y",
            "side": "right",
            "showgrid": False,
            "rangemode": "tozero",
        },
        "legend": {"orientation": "h", "y": -0.3},
        "margin": {"l": 60, "r": 60, "t": 10, "b": 40},
    }


def loss_figure(samples: list[tuple[float, float | None, float | None]]) -> dict:
    """Loss and tokens/s over time from training samples: (unix s, loss, tokens/s), sorted."""
    if len(samples) > MAX_POINTS:
        stride = len(samples) / MAX_POINTS
        samples = [samples[int(i * stride)] for i in range(MAX_POINTS)] + [samples[-1]]
    x = [ms(t) for t, _, _ in samples]
    traces = [
        {
            "type": "scatter",
            "mode": "lines",
            "name": "loss",
            "x": x,
            "y": [loss for _, loss, _ in samples],
            "line": {"color": "#e15759"},
            "connectgaps": False,
            "hovertemplate": "loss %{y:.4f}<br>%{x}<extra></extra>",
        },
        {
            "type": "scatter",
            "mode": "lines",
            "name": "tokens/s",
            "x": x,
            "y": [tps for _, _, tps in samples],
            "yaxis": "y2",
            "line": {"color": "#76b7b2"},
            "hovertemplate": "%{y:,.0f} tokens/s<extra></extra>",
        },
    ]
    layout = _time_series_layout(uirevision="loss", y_title="loss", y2_title="tokens/s", y_from_zero=False)
    return {"figure": {"data": traces, "layout": layout}}
