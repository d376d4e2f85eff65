"""The recovery timeline figure: one lane per rank (grouped by node) and a job lane, phase bars,
restart-cycle bands, fault markers and operator commands, downsampled so a long job stays light.

The spans it draws come from ``timeline.py`` (facts -> phases); the words and number formats from
``words.py``; the "control plane unavailable" bands are added to the finished figure by ``outage_bands.py``.
"""

from __future__ import annotations

from collections import defaultdict

from controlplane.dashboard.plots.downsample import downsample_spans
from controlplane.dashboard.plots.style import BASE_LAYOUT, esc, hms, markers, ms, spaced
from controlplane.dashboard.timeline import (
    CHECKPOINT_LOAD,
    CHECKPOINT_SAVE,
    DEAD,
    HUNG,
    PHASES,
    RESTARTING,
    STARTING,
    STRAGGLER,
    TRAINING,
    Span,
)
from controlplane.dashboard.words import LAYER_NAMES, fmt_s

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
    STRAGGLER: "#76b7b2",
}
LAYER_COLORS = {"in_process": "#59a14f", "in_job": "#f28e2b", "job": "#e15759", "none": "#7f7f7f"}
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


def timeline_figure(
    *,
    lanes: list[dict],
    spans: list[Span],
    faults: list[dict],
    cycles: list[dict],
    commands: list[dict],
    decisions: list[dict] = (),
    t0: float,
    t1: float,
    now: float,
) -> dict:
    """Lanes: the job lane (y=0: cycles, commands, rank-less faults) then one per rank, grouped by node.

    A lane is ``{"rank", "node"}`` (a rank's lane), or ``{"key", "label", "node"}`` (a node lane of a
    large job: spans whose ``lane`` and faults whose ``"lane"`` is that key are drawn in it).

    Returns ``{"figure": ..., "open": [[trace, point], ...], "now_ms": ...}``; the page extends the
    open bars to the present while it follows live.
    """
    n = len(lanes)
    lane_y = {ln.get("key", ln.get("rank")): i + 1 for i, ln in enumerate(lanes)}
    lane_words = {ln.get("key", ln.get("rank")): ln.get("label") for ln in lanes}
    traces, open_points = _phase_bars(downsample_spans(spans, t0, t1), n, lane_y, lane_words)
    shapes, by_layer = _cycle_bands(cycles, t0, t1, now)
    # An operator's restart starts when its command was issued, where the command's marker would sit on
    # top of it and take its hover: the restart's marker says who asked instead, and the command has none.
    by_command = {c["id"]: c for c in commands if c.get("id") is not None}
    restarted = {c["command_id"] for c in cycles if c.get("command_id") is not None}
    traces += _cycle_markers(by_layer, by_command, t0, t1)
    traces += _fault_markers(faults, lane_y, t0, t1)
    traces += _command_markers(
        [c for c in commands if t0 <= c["issued_at"] <= t1 and c.get("id") not in restarted]
    )
    traces += _decision_markers([d for d in decisions if t0 <= d["at"] <= t1])
    shapes += _node_lines(lanes)
    plot_height = plot_height_for(n)
    return {
        "figure": {"data": traces, "layout": _layout(lanes, shapes, t0, t1, plot_height)},
        "open": open_points,
        "now_ms": ms(now),
        "plot_height": plot_height,
    }


def _phase_bars(
    spans: list[Span], n: int, lane_y: dict, lane_words: dict
) -> tuple[list[dict], list[list[int]]]:
    """One bar trace per phase (a job-wide span covers every lane), and the [trace, point] of each open
    bar."""
    traces: list[dict] = []
    open_points: list[list[int]] = []
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
                who = lane_words.get(s.lane) or f"rank {s.lane}"
            base.append(ms(s.start))
            length.append(max(1, ms(s.end) - ms(s.start)))
            dur = "running" if s.open else fmt_s(s.end - s.start)
            text.append(
                f"<b>{phase}</b> · {who}<br>{esc(s.label)}<br>{hms(s.start)} → "
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
    return traces, open_points


def _cycle_bands(
    cycles: list[dict], t0: float, t1: float, now: float
) -> tuple[list[dict], dict[str, list[dict]]]:
    """A band over every lane per restart cycle in view (to its first step, or now), and those cycles by
    layer."""
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
    return shapes, by_layer


def _cycle_markers(by_layer: dict[str, list[dict]], by_command: dict, t0: float, t1: float) -> list[dict]:
    """A diamond per restart on the job lane, one trace per layer; labelled while there are few, and only
    those far enough apart."""
    traces: list[dict] = []
    labelled = sum(len(v) for v in by_layer.values()) <= MAX_LABELLED
    everyone = [c for items in by_layer.values() for c in items]
    label_ok = {id(c): ok for c, ok in zip(everyone, spaced([c["start"] for c in everyone], t1 - t0),
                                           strict=True)}
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
                "text": [f"{LAYER_NAMES.get(layer, layer)} {fmt_s(c['recovery_s'])}"
                         if label_ok[id(c)] else "" for c in items],
                "textposition": "middle right",
                "textfont": {"size": 10},
                "marker": {"symbol": "diamond", "size": 11, "color": LAYER_COLORS.get(layer, "#7f7f7f")},
                "customdata": [
                    f"<b>{c['title']}</b> at {hms(c['start'])} UTC"
                    f"{'<br>' + esc(c['reason']) if c['reason'] else ''}"
                    f"{_asked_by(by_command.get(c.get('command_id')))}<br>"
                    + " · ".join(f"{k.replace('_', ' ')} {fmt_s(v)}" for k, v in dd.items())
                    + f"<br>recovery {fmt_s(c['recovery_s']) if c['first_step_at'] else 'in progress'}"
                    + (f" · steps lost {c['lost_steps']}" if c["lost_steps"] is not None else "")
                    for c, dd in zip(items, d, strict=True)
                ],
                "hovertemplate": "%{customdata}<extra></extra>",
            }
        )
    return traces


def _fault_markers(faults: list[dict], lane_y: dict, t0: float, t1: float) -> list[dict]:
    """A cross per fault in view (the newest ``MAX_FAULT_MARKERS``) on its rank's lane, one trace per
    class."""
    traces: list[dict] = []
    visible = [f for f in faults if t0 <= f["at"] <= t1][-MAX_FAULT_MARKERS:]
    by_class: dict[str, list[dict]] = defaultdict(list)
    for f in visible:
        by_class[f["fault_class"]].append(f)
    labelled = len(visible) <= MAX_LABELLED
    fault_lane = [lane_y.get(f.get("lane", f["rank"]), 0) for f in visible]
    fault_label = {}
    for y in set(fault_lane):
        mine = [f for f, fy in zip(visible, fault_lane, strict=True) if fy == y]
        fault_label.update({id(f): ok for f, ok in zip(mine, spaced([f["at"] for f in mine], t1 - t0),
                                                       strict=True)})
    for cls, items in sorted(by_class.items()):
        traces.append(
            {
                "type": "scatter",
                "mode": "markers+text" if labelled else "markers",
                "name": f"fault · {cls}",
                "legendgroup": "fault",
                "x": [ms(f["at"]) for f in items],
                "y": [lane_y.get(f.get("lane", f["rank"]), 0) for f in items],
                "text": [cls if fault_label[id(f)] else "" for f in items] if labelled else None,
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
                    f"{' (' + esc(f['node']) + ')' if f['node'] else ''}<br>at {hms(f['at'])} UTC"
                    f" · detected by {f['detected_by']} after {fmt_s(f['detection_s'])}"
                    f"{'<br>' + fault_outcome_words(f) if f['layer'] else ''}"
                    f"<br>{esc((f['message'] or '')[:160])}"
                    for f in items
                ],
                "hovertemplate": "%{customdata}<extra></extra>",
            }
        )
        if not labelled:
            del traces[-1]["text"]
    return traces


def _command_markers(cmds: list[dict]) -> list[dict]:
    """The operator's commands in view (those that started no restart) on the job lane."""
    if not cmds:
        return []
    return [
        markers(
            "operator command",
            legendgroup="command",
            x=[ms(c["issued_at"]) for c in cmds],
            y=[0] * len(cmds),
            marker={"symbol": "triangle-down", "size": 11, "color": "#333"},
            customdata=[f"<b>{esc(c['summary'])}</b><br>by {esc(c['by'])} · {c['status']}" for c in cmds],
        )
    ]


def _decision_markers(picked: list[dict]) -> list[dict]:
    """The failure policy's decisions in view on the job lane (grey: no rule matched)."""
    if not picked:
        return []
    return [
        markers(
            "policy decision",
            legendgroup="policy",
            x=[ms(d["at"]) for d in picked],
            y=[0] * len(picked),
            marker={"symbol": "diamond", "size": 9,
                    "color": ["#b07aa1" if d["rule"] else "#bab0ac" for d in picked]},
            customdata=[f"<b>{esc(d['subject'])}: {esc(d['words'])}</b><br>{esc(d['why'])}" for d in picked],
        )
    ]


def _node_lines(lanes: list[dict]) -> list[dict]:
    """Node groups: a line between nodes (the node is in each rank's tick label)."""
    shapes: list[dict] = []
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
    return shapes


def _layout(lanes: list[dict], shapes: list[dict], t0: float, t1: float, plot_height: int) -> dict:
    n = len(lanes)
    # A rank's node shows once its first heartbeat names it; until then the lane is just the rank.
    ticktext = ["job"] + [
        ln.get("label") or (f"r{ln['rank']} · {ln['node']}" if ln["node"] else f"r{ln['rank']}") for ln in lanes
    ]
    return {
        **BASE_LAYOUT,
        # The page keeps the plot area at plot_height whatever the legend takes (job.js keepPlotHeight);
        # this first guess leaves room for a legend of about three rows.
        "height": plot_height + LEGEND_GUESS_PX + 40,
        "barmode": "overlay",
        "bargap": 0,
        "dragmode": "zoom",
        "uirevision": "timeline",
        "showlegend": True,
        # Entries flow in rows ("normal" order; grouped legends stack each group as a tall column).
        "legend": {
            "orientation": "h",
            "traceorder": "normal",
            "x": 0,
            "y": 1.0,
            "yanchor": "bottom",
            "font": {"size": 11},
        },
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
            # A fixed range (reversed: the job lane on top) so every lane gets its share of plot_height;
            # autorange would pad for marker labels and leave empty lanes' worth of space.
            "autorange": False,
            "fixedrange": True,
            "tickfont": {"size": 10 if n > 16 else 11},
            "range": [n + 0.6, -0.6],
        },
        "shapes": shapes,
        "margin": {"l": 130, "r": 20, "t": 30, "b": 40},
    }


LEGEND_GUESS_PX = 70


def fault_outcome_words(f: dict) -> str:
    """The recovery part of a fault's hover, from the same outcome as the fault table's row."""
    layer = LAYER_NAMES.get(f["layer"], f["layer"])
    if f["recovery_s"] is not None:
        rec = f"recovered by the {layer} layer in {fmt_s(f['recovery_s'])}"
    else:
        rec = f"{layer} restart in progress" if f["recovering"] else f"handled by the {layer} layer"
    return rec + (f" · steps lost {f['lost_steps']}" if f["lost_steps"] is not None else "")


def plot_height_for(lanes: int) -> int:
    """Pixels of the plot area for ``lanes`` rank lanes plus the job lane: roomy for a few ranks,
    compact (but readable) for many."""
    per_lane = 26 if lanes <= 8 else 18 if lanes <= 32 else 14
    return max(140, per_lane * (lanes + 1))


def _asked_by(command: dict | None) -> str:
    """An operator's restart: the command that asked for it, in its cycle's hover."""
    if command is None:
        return ""
    return f"<br>asked for by {esc(command['by'])}: {esc(command['summary'])} ({esc(command['status'])})"
