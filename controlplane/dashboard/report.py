"""The resilience report as a page and as one self-contained HTML file (plotly, the style sheet and the
drawing script inlined: it opens with no network, in a closed VPC or attached to a ticket).

The figures come from ``jobs.resilience_report.build_report``, the same object the API serialises; this
module only formats them and builds the plotly figure dicts.
"""

from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.shortcuts import get_object_or_404, render
from django.template.loader import render_to_string
from django.views.decorators.http import require_GET

from controlplane.dashboard.assets import PLOTLY_VERSION, _plotly_bytes
from controlplane.dashboard.plots.style import BASE_LAYOUT
from controlplane.dashboard.words import LAYER_NAMES, fmt_s
from controlplane.jobs import projection
from controlplane.jobs.models import Job
from controlplane.jobs.resilience_report import OPERATOR, Report, build_report
from controlplane.jobs.roles import is_operator

PHASE_COLOURS = {"deliver": "#b0b0b0", "detect": "#d62728", "abort": "#ff7f0e", "restart": "#9467bd",
                 "reload": "#1f77b4", "first_step": "#2ca02c"}
STATIC = Path(settings.BASE_DIR) / "static"


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f} %"


def _phase_figure(r: Report) -> dict:
    phases = r.recovery.phases
    return {"data": [
        {"type": "bar", "name": stat, "x": [p.name.replace("_", " ") for p in phases],
         "y": [getattr(p, f"{stat}_s") for p in phases], "marker": {"color": colour}}
        for stat, colour in (("p50", "#1f77b4"), ("p95", "#aec7e8"))
    ], "layout": {**BASE_LAYOUT, "barmode": "group", "height": 280,
                  "margin": {"l": 60, "r": 20, "t": 20, "b": 40},
                  "yaxis": {"title": {"text": "seconds"}, "rangemode": "tozero"}}}


def _save_figure(r: Report) -> dict:
    traces = []
    for mode in ("async", "sync"):
        rows = [s for s in r.saves.rows if s.mode == mode and s.cost_s is not None]
        if not rows:
            continue
        x = [s.step for s in rows]
        traces.append({"type": "bar", "name": f"{mode}: blocked", "x": x,
                       "y": [s.blocking_s or 0 for s in rows]})
        traces.append({"type": "bar", "name": f"{mode}: slower steps", "x": x,
                       "y": [s.interference_s or 0 for s in rows]})
    return {"data": traces, "layout": {**BASE_LAYOUT, "barmode": "stack", "height": 260,
                                       "margin": {"l": 60, "r": 20, "t": 20, "b": 40},
                                       "xaxis": {"title": {"text": "step saved"}},
                                       "yaxis": {"title": {"text": "seconds the loop lost"}}}}


def _scale_figure(r: Report) -> dict | None:
    s = r.at_scale
    if s is None or not s.mtbf_s:
        return None
    lam = 1 / s.mtbf_s
    top = max([s.interval_s * 4] + [(x.best_interval_s or 0) * 3 for x in s.scenarios])
    xs = [s.step_time_s + (top - s.step_time_s) * i / 199 for i in range(200)]
    traces = []
    for x in s.scenarios:
        traces.append({"type": "scatter", "mode": "lines", "name": x.name, "x": [v / 60 for v in xs],
                       "y": [100 * projection.goodput(interval_s=v, save_cost_s=s.save_cost_s, rate_per_s=lam,
                                                      recovery_s=x.recovery_s) for v in xs]})
        if x.best_interval_s is not None:
            traces.append({"type": "scatter", "mode": "markers",
                           "name": f"best: every {x.best_interval_steps} steps",
                           "x": [x.best_interval_steps * s.step_time_s / 60], "y": [100 * x.goodput_best],
                           "marker": {"size": 10, "symbol": "diamond"}})
    return {"data": traces, "layout": {
        **BASE_LAYOUT, "height": 320, "margin": {"l": 60, "r": 20, "t": 20, "b": 50},
        "xaxis": {"title": {"text": "minutes of training between checkpoints"}},
        "yaxis": {"title": {"text": "expected goodput (%)"}},
        "shapes": [{"type": "line", "x0": s.interval_s / 60, "x1": s.interval_s / 60, "y0": 0, "y1": 1,
                    "yref": "paper", "line": {"dash": "dot", "color": "#888"}}]}}


def context(r: Report, *, base_url: str = "") -> dict:
    """What the report's body template shows; ``base_url`` prefixes the links (the HTML file's)."""
    def link(path: str) -> str:
        return f"{base_url}{path}" if path else ""

    classes = [{"row": c,
                "name": "operator restart (no fault)" if c.fault_class == OPERATOR else c.fault_class,
                "layers": ", ".join(f"{LAYER_NAMES.get(k, k)} × {n}" for k, n in c.layers.items())
                or "–",
                "detection": (fmt_s(c.detection.p50_s), fmt_s(c.detection.p95_s)),
                "recovery": (fmt_s(c.recovery.p50_s), fmt_s(c.recovery.p95_s)),
                "faults_link": link(c.links["faults"]), "cycles_link": link(c.links["cycles"]),
                "fault_links": [(i, link(f"{r.links['faults']}/{i}")) for i in c.fault_ids[:20]]}
               for c in r.classes]
    figs = {"phases": _phase_figure(r), "saves": _save_figure(r), "scale": _scale_figure(r)}
    return {
        "r": r, "classes": classes, "links": {k: link(v) for k, v in r.links.items()},
        "fmt_phases": [(p, fmt_s(p.p50_s), fmt_s(p.p95_s)) for p in r.recovery.phases],
        "layers": [(LAYER_NAMES.get(x.layer, x.layer), x, fmt_s(x.recovery.p50_s),
                    fmt_s(x.recovery.p95_s)) for x in r.recovery.by_layer],
        "detection": (fmt_s(r.recovery.detection.p50_s), fmt_s(r.recovery.detection.p95_s)),
        "recovery": (fmt_s(r.recovery.recovery.p50_s), fmt_s(r.recovery.recovery.p95_s)),
        "reload_share": _pct(r.recovery.reload_share),
        "goodput_pct": _pct(r.goodput.get("goodput")),
        "saves": {"async": (fmt_s(r.saves.async_cost.p50_s), fmt_s(r.saves.async_cost.p95_s)),
                  "sync": (fmt_s(r.saves.sync_cost.p50_s), fmt_s(r.saves.sync_cost.p95_s))},
        "scale": r.at_scale,
        "scenarios": [(x, _pct(x.goodput_now), _pct(x.goodput_best), fmt_s(x.best_interval_s))
                      for x in (r.at_scale.scenarios if r.at_scale else [])],
        "mtbf": fmt_s(r.at_scale.mtbf_s) if r.at_scale else "–",
        "figures": {k: v for k, v in figs.items() if v is not None},
    }


@login_required
@require_GET
def report_page(request, job_id: int):
    job = get_object_or_404(Job, pk=job_id)
    r = build_report(job)
    return render(request, "dashboard/report.html", {
        **context(r), "job": job, "plotly_version": PLOTLY_VERSION, "is_operator": is_operator(request.user)})


def standalone_html(r: Report, *, base_url: str = "") -> str:
    """The report as one HTML file: no request leaves it (plotly, CSS and the script are inlined)."""
    raw, _ = _plotly_bytes()
    return render_to_string("dashboard/report_file.html", {
        **context(r, base_url=base_url),
        "inline_css": (STATIC / "css" / "unbroken.css").read_text(encoding="utf-8"),
        # "</script" cannot appear inside a script element; plotly's minified source does not hold it.
        "inline_plotly": raw.decode("utf-8").replace("</script", "<\\/script"),
        "inline_js": (STATIC / "js" / "report.js").read_text(encoding="utf-8"),
    })
