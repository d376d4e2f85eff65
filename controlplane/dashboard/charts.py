"""Plotly figure dicts, built and downsampled on the server (the page only renders them).

Every builder returns plain JSON-able dicts. Times on the wire are unix milliseconds (plotly reads
them as UTC on a date axis); durations are seconds in labels and milliseconds as bar lengths.
Downsampling keeps each figure to a bounded number of marks whatever the job's length
(``MAX_POINTS`` checkpoint points; the recovery timeline, in ``timeline_figure.py``, bins its bars).
"""

from __future__ import annotations

from datetime import UTC, datetime

from controlplane.jobs.models import LAYER_WORDS

MAX_POINTS = 600
LAYER_NAMES = LAYER_WORDS
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


# -- checkpoints --------------------------------------------------------------------------------------


def checkpoint_figure(rows: list[dict]) -> dict:
    """Per save: blocked time, interference (async: the extra time of the steps it slowed down) and
    time to durable (log seconds), write throughput (MB/s, right axis).

    ``rows``: started_at, step, mode, state, blocking_s, interference_s, durable_s (or None), elapsed_s,
    mb_per_s.
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
                r.get("interference_s"),
            ]
            for r in sel
        ]

    def template(mode: str) -> str:
        return (
            f"<b>step %{{customdata[0]}}</b> · {mode} · %{{customdata[1]}}<br>started %{{x|%H:%M:%S}} UTC"
            "<br>loop blocked %{customdata[2]:.3f} s · slower steps %{customdata[5]:.3f} s"
            "<br>durable after %{customdata[3]:.2f} s"
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
        slow = [r for r in sel if r.get("interference_s") is not None]
        if slow:
            traces.append(
                {
                    "type": "scatter",
                    "mode": "markers",
                    "name": f"slower steps · {mode}",
                    "x": [ms(r["started_at"]) for r in slow],
                    # log axis: a save that slowed nothing is drawn at 1 ms
                    "y": [max(r["interference_s"], 0.001) for r in slow],
                    "marker": {"symbol": "triangle-up", "size": 7, "color": "#76b7b2"},
                    "customdata": custom(slow),
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


def progress_figure(points: list[tuple[float, int]], rates: list[tuple[float, float]]) -> dict:
    """Step over time (``points``: (unix s, step), sorted) and throughput on the right axis from the
    trainer's own step times (``rates``: (unix s, seconds per step) from training samples). Throughput is
    never a step delta between points: across a rollback that would draw the restart as speed. No step
    time reported: no throughput trace and no right axis."""
    if len(points) > MAX_POINTS:
        stride = len(points) / MAX_POINTS
        points = [points[int(i * stride)] for i in range(MAX_POINTS)] + [points[-1]]
    rates = [(t, st) for t, st in rates if st and st > 0]
    if len(rates) > MAX_POINTS:
        stride = len(rates) / MAX_POINTS
        rates = [rates[int(i * stride)] for i in range(MAX_POINTS)] + [rates[-1]]
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
    ]
    if rates:
        traces.append({
            "type": "scatter",
            "mode": "lines",
            "name": "throughput (steps/s, trainer's step time)",
            "x": [ms(t) for t, _ in rates],
            "y": [round(1.0 / st, 3) for _, st in rates],
            "yaxis": "y2",
            "line": {"color": "#f28e2b"},
            "hovertemplate": "%{y:.2f} steps/s<extra></extra>",
        })
    layout = _time_series_layout(uirevision="progress", y_title="step", y2_title="steps/s" if rates else None,
                                 y_from_zero=True)
    return {"figure": {"data": traces, "layout": layout}}


def _time_series_layout(*, uirevision: str, y_title: str, y2_title: str | None, y_from_zero: bool) -> dict:
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
    if y2_title is None:
        del layout["yaxis2"]
    return layout


def loss_figure(samples: list[tuple[float, float | None, float | None]]) -> dict | None:
    """Loss and tokens/s over time from training samples: (unix s, loss, tokens/s), sorted. Each series
    draws only the samples that carry it (a sample without it, such as the first after a restart, leaves
    no hole); a series no sample carries is not drawn, nor its axis; None when neither is."""
    if len(samples) > MAX_POINTS:
        stride = len(samples) / MAX_POINTS
        samples = [samples[int(i * stride)] for i in range(MAX_POINTS)] + [samples[-1]]
    loss = [(ms(t), v) for t, v, _ in samples if v is not None]
    tps = [(ms(t), v) for t, _, v in samples if v is not None]
    if not loss and not tps:
        return None
    traces = []
    if loss:
        traces.append({
            "type": "scatter",
            "mode": "lines",
            "name": "loss",
            "x": [x for x, _ in loss],
            "y": [y for _, y in loss],
            "line": {"color": "#e15759"},
            "hovertemplate": "loss %{y:.4f}<br>%{x}<extra></extra>",
        })
    if tps:
        traces.append({
            "type": "scatter",
            "mode": "lines",
            "name": "tokens/s",
            "x": [x for x, _ in tps],
            "y": [y for _, y in tps],
            "yaxis": "y2" if loss else "y",
            "line": {"color": "#76b7b2"},
            "hovertemplate": "%{y:,.0f} tokens/s<extra></extra>",
        })
    layout = _time_series_layout(uirevision="loss", y_title="loss" if loss else "tokens/s",
                                 y2_title="tokens/s" if loss and tps else None, y_from_zero=not loss)
    return {"figure": {"data": traces, "layout": layout}}
