"""The checkpoint chart: per save, the loop's blocked time, the slower steps of an async save, the time to
durable (log seconds) and the write throughput (MB/s, right axis)."""

from __future__ import annotations

from controlplane.dashboard.plots.downsample import downsample_points
from controlplane.dashboard.plots.style import BASE_LAYOUT, markers, ms, right_axis


def checkpoint_figure(rows: list[dict]) -> dict:
    """Per save: blocked time, interference (async: the extra time of the steps it slowed down) and
    time to durable (log seconds), write throughput (MB/s, right axis).

    ``rows``: started_at, step, mode, state, blocking_s, interference_s, durable_s (or None), elapsed_s,
    mb_per_s.
    """
    total = len(rows)
    rows = downsample_points(rows, key="durable_s", keep=lambda r: r["state"] in ("failed", "abandoned"))
    traces = []
    for mode, symbol in (("sync", "square"), ("async", "circle")):
        traces += _save_traces(rows, mode, symbol)
    traces += _failed_traces(rows)
    traces += _throughput_trace(rows)
    note = f"{total} saves" + (f", {len(rows)} shown (spikes and failures kept)" if len(rows) < total else "")
    return {"figure": {"data": traces, "layout": _layout(note)}}


def _custom(sel: list[dict]) -> list[list]:
    """Hover from numbers (customdata + hovertemplate): a preformatted string per point would triple the
    payload of a long job's chart."""
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


def _template(mode: str) -> str:
    return (
        f"<b>step %{{customdata[0]}}</b> · {mode} · %{{customdata[1]}}<br>started %{{x|%H:%M:%S}} UTC"
        "<br>loop blocked %{customdata[2]:.3f} s · slower steps %{customdata[5]:.3f} s"
        "<br>durable after %{customdata[3]:.2f} s"
        "<br>write %{customdata[4]} MB/s<extra></extra>"
    )


def _saves(name: str, sel: list[dict], y: list, marker: dict, what: str) -> dict:
    """One marker per save in ``sel`` at the time it started, its hover the save's figures."""
    return markers(name, x=[ms(r["started_at"]) for r in sel], y=y, marker=marker, customdata=_custom(sel),
                   hovertemplate=_template(what))


def _save_traces(rows: list[dict], mode: str, symbol: str) -> list[dict]:
    """A ``mode`` (sync or async) save's blocked time, slower steps and time to durable, for the saves
    that did not fail."""
    traces: list[dict] = []
    sel = [r for r in rows if r["mode"] == mode and r["state"] in ("durable", "in_flight")]
    if not sel:
        return traces
    traces.append(_saves(f"blocked · {mode}", sel, [r["blocking_s"] for r in sel],
                         {"symbol": symbol, "size": 7, "color": "#4e79a7"}, mode))
    slow = [r for r in sel if r.get("interference_s") is not None]
    if slow:
        # log axis: a save that slowed nothing is drawn at 1 ms
        traces.append(_saves(f"slower steps · {mode}", slow, [max(r["interference_s"], 0.001) for r in slow],
                             {"symbol": "triangle-up", "size": 7, "color": "#76b7b2"}, mode))
    dur = [r for r in sel if r["durable_s"] is not None]
    if dur:
        durable = {"symbol": symbol + "-open", "size": 8, "color": "#59a14f", "line": {"width": 2}}
        traces.append(_saves(f"time to durable · {mode}", dur, [r["durable_s"] for r in dur], durable, mode))
    return traces


def _failed_traces(rows: list[dict]) -> list[dict]:
    """A cross per failed or abandoned save, at the time it took before it gave up."""
    traces: list[dict] = []
    for state, color in (("failed", "#c0392b"), ("abandoned", "#ff7f0e")):
        sel = [r for r in rows if r["state"] == state]
        if sel:
            traces.append(_saves(state, sel, [r["elapsed_s"] or r["blocking_s"] or 0.001 for r in sel],
                                 {"symbol": "x", "size": 11, "color": color}, "save"))
    return traces


def _throughput_trace(rows: list[dict]) -> list[dict]:
    """The saves' write throughput on the right axis (none without a figure)."""
    thr = [r for r in rows if r["mb_per_s"]]
    if not thr:
        return []
    return [
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
    ]


def _layout(note: str) -> dict:
    return {
        **BASE_LAYOUT,
        "height": 320,
        "uirevision": "ckpt",
        "title": {"text": note, "font": {"size": 12}, "x": 0.01},
        "xaxis": {"type": "date", "title": {"text": "save started (UTC)"}},
        "yaxis": {"type": "log", "dtick": 1, "title": {"text": "seconds (log scale)"}},
        "yaxis2": right_axis("MB/s"),
        "legend": {"orientation": "h", "y": -0.25},
        "margin": {"l": 60, "r": 60, "t": 30, "b": 40},
    }
