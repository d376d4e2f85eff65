"""The progress charts: step and throughput over time, and loss and tokens/s from training samples."""

from __future__ import annotations

from controlplane.dashboard.plots.downsample import MAX_POINTS
from controlplane.dashboard.plots.style import ms, time_series_layout


def _thinned(seq: list) -> list:
    """At most ``MAX_POINTS`` evenly spaced items of ``seq``, then its last (the newest is always drawn)."""
    if len(seq) <= MAX_POINTS:
        return seq
    stride = len(seq) / MAX_POINTS
    return [seq[int(i * stride)] for i in range(MAX_POINTS)] + [seq[-1]]


def _line(name: str, x: list, y: list, color: str, hovertemplate: str, **more) -> dict:
    """A line trace; ``more``: further trace keys (``yaxis``)."""
    return {"type": "scatter", "mode": "lines", "name": name, "x": x, "y": y, **more,
            "line": {"color": color}, "hovertemplate": hovertemplate}


def progress_figure(points: list[tuple[float, int]], rates: list[tuple[float, float]]) -> dict:
    """Step over time (``points``: (unix s, step), sorted) and throughput on the right axis from the
    trainer's own step times (``rates``: (unix s, seconds per step) from training samples). Throughput is
    never a step delta between points: across a rollback that would draw the restart as speed. No step
    time reported: no throughput trace and no right axis."""
    points = _thinned(points)
    rates = _thinned([(t, st) for t, st in rates if st and st > 0])
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
        traces.append(_line("throughput (steps/s, trainer's step time)", [ms(t) for t, _ in rates],
                            [round(1.0 / st, 3) for _, st in rates], "#f28e2b",
                            "%{y:.2f} steps/s<extra></extra>", yaxis="y2"))
    layout = time_series_layout(uirevision="progress", y_title="step", y2_title="steps/s" if rates else None,
                                 y_from_zero=True)
    return {"figure": {"data": traces, "layout": layout}}


def loss_figure(samples: list[tuple[float, float | None, float | None]]) -> dict | None:
    """Loss and tokens/s over time from training samples: (unix s, loss, tokens/s), sorted. Each series
    draws only the samples that carry it (a sample without it, such as the first after a restart, leaves
    no hole); a series no sample carries is not drawn, nor its axis; None when neither is."""
    samples = _thinned(samples)
    loss = [(ms(t), v) for t, v, _ in samples if v is not None]
    tps = [(ms(t), v) for t, _, v in samples if v is not None]
    if not loss and not tps:
        return None
    traces = []
    if loss:
        traces.append(_line("loss", [x for x, _ in loss], [y for _, y in loss], "#e15759",
                            "loss %{y:.4f}<br>%{x}<extra></extra>"))
    if tps:
        traces.append(_line("tokens/s", [x for x, _ in tps], [y for _, y in tps], "#76b7b2",
                            "%{y:,.0f} tokens/s<extra></extra>", yaxis="y2" if loss else "y"))
    layout = time_series_layout(uirevision="loss", y_title="loss" if loss else "tokens/s",
                                 y2_title="tokens/s" if loss and tps else None, y_from_zero=not loss)
    return {"figure": {"data": traces, "layout": layout}}
