"""What each part of the job page shows, and a cheap signature per part for cursor polling.

A page polls ``live`` with the signatures it has; the server recomputes them (a handful of indexed
aggregates, no row scans of the event log) and names only the parts whose signature moved, which
the page then fetches from their own fragment endpoints. Nothing unchanged is re-sent.
"""

from __future__ import annotations

import hashlib
import os
from datetime import datetime, timedelta

from django.core.paginator import Paginator
from django.db.models import Count, Max, Q

from controlplane.dashboard import charts, fleet
from controlplane.dashboard.timeline_figure import timeline_figure
from controlplane.dashboard.outage_band import add_outage_bands
from controlplane.dashboard.timeline import STRAGGLER, Span, job_spans, rank_spans, ts
from controlplane.jobs import figures, health, outages, policy
from controlplane.jobs.policy import POLICY_EVENT
from controlplane.jobs.goodput import PARTS, Epoch
from controlplane.jobs.stragglers import STRAGGLER_EVENT, straggler_spans
from controlplane.jobs.models import (
    AuditEntry,
    Checkpoint,
    Command,
    Event,
    Fault,
    Job,
    Outage,
    QuarantinedHeartbeat,
    Rank,
    RestartCycle,
    TrainingSample,
)
from controlplane.launchers.logs import log_tail
from trainer.policy import ACTION_WORDS
from trainer.wire import CheckpointState, Layer, redact

FOLLOW_WINDOW_S = 600.0
FAULTS_PER_PAGE = 25
JOB_SECTIONS = (
    "header",
    "actions",
    "timeline",
    "checkpoints",
    "faults",
    "goodput",
    "ranks",
    "progress",
    "commands",
    "audit",
    "log",
)


def _sig(*parts) -> str:
    return hashlib.blake2s(repr(parts).encode(), digest_size=6).hexdigest()


# -- signatures --------------------------------------------------------------------------------------


def job_signatures(job: Job, now: datetime) -> dict[str, str]:
    cyc = RestartCycle.objects.filter(job=job).aggregate(
        n=Count("id"),
        m=Max("id"),
        d=Count("detected_at"),
        a=Count("aborted_at"),
        r=Count("restarted_at"),
        lo=Count("checkpoint_loaded_at"),
        f=Count("first_step_at"),
        rs=Count("resumed_from_step"),
        sf=Count("step_at_fault"),
    )
    flt = Fault.objects.filter(job=job).aggregate(n=Count("id"), m=Max("id"))
    ck = Checkpoint.objects.filter(job=job).aggregate(
        n=Count("id"),
        m=Max("id"),
        d=Count("id", filter=Q(state=CheckpointState.DURABLE)),
        x=Count("id", filter=Q(state__in=(CheckpointState.FAILED, CheckpointState.ABANDONED))),
    )
    rk = Rank.objects.filter(job=job).aggregate(
        hb=Max("last_heartbeat_at"), lost=Count("lost_at"), stl=Count("stalled_at"), st=Max("step_changed_at")
    )
    cmd = Command.objects.filter(job=job).aggregate(
        n=Count("id"), m=Max("id"), done=Count("acked_at"), dl=Count("delivered_at")
    )
    aud = AuditEntry.objects.filter(job=job).aggregate(m=Max("id"))
    band = Outage.objects.filter(component__in=Outage.GRACE).aggregate(n=Count("id"), e=Count("ended_at"))
    qua = QuarantinedHeartbeat.objects.filter(job=job).aggregate(n=Count("id"), at=Max("at"))
    pol = Event.objects.filter(job=job, kind=POLICY_EVENT).aggregate(n=Count("id"), m=Max("id"))
    status = (
        job.status,
        job.status_reason,
        job.status_changed_at,
        job.attempt,
        job.first_step_at,
        job.finished_at,
    )
    cyc_s, flt_s, ck_s = tuple(cyc.values()), tuple(flt.values()), tuple(ck.values())
    rank_health = (rk["lost"], rk["stl"])
    # A large job's ranks beat all the time: its health part (a heatmap) refreshes at most every 2 s.
    rk_sig = (rank_health, int(now.timestamp() // 2)) if fleet.is_large(job) else tuple(rk.values())
    # Parts that move with time alone (goodput of a running job) refresh at most every 5 s.
    tick = int(now.timestamp() // 5) if job.is_active else 0
    return {
        "header": _sig(status, job.last_step, tick),
        "actions": _sig(job.is_active, bool((job.launcher_state or {}).get("held"))),
        "timeline": _sig(status, cyc_s, flt_s, ck_s, rank_health, tuple(cmd.values()), tuple(band.values()),
                         tuple(pol.values())),
        "checkpoints": _sig(ck_s),
        "faults": _sig(flt_s, cyc_s, status, job.last_progress_at, tuple(pol.values())),
        "goodput": _sig(status, cyc_s, ck_s, job.last_step, tick),
        "ranks": _sig(rk_sig, tuple(qua.values())),
        "progress": _sig(ck_s, cyc_s, tick),
        "commands": _sig(tuple(cmd.values())),
        "audit": _sig(aud["m"]),
        "log": _sig(log_stat(job)),
    }


def log_stat(job: Job) -> tuple:
    path = (job.launcher_state or {}).get("log") if job.backend == "local" else None
    if not path:
        return ()
    try:
        st = os.stat(path)
    except OSError:
        return ()
    return (st.st_size, st.st_mtime_ns)


def jobs_signature(jobs: list[Job]) -> str:
    ids = [j.pk for j in jobs]
    extra = (
        Fault.objects.filter(job_id__in=ids).aggregate(m=Max("id"))["m"],
        RestartCycle.objects.filter(job_id__in=ids).aggregate(m=Max("id"), f=Count("first_step_at")),
        Checkpoint.objects.filter(job_id__in=ids, state=CheckpointState.DURABLE).aggregate(m=Max("id"))["m"],
    )
    return _sig([(j.pk, j.status, j.status_reason, j.last_step, j.status_changed_at) for j in jobs], extra)


# -- job list ------------------------------------------------------------------------------------------


def job_rows(jobs: list[Job], now: datetime) -> list[dict]:
    ids = [j.pk for j in jobs]
    restarts = figures.restarts_by_layer(ids)
    durable = dict(
        Checkpoint.objects.filter(job_id__in=ids, state=CheckpointState.DURABLE)
        .values_list("job_id")
        .annotate(m=Max("finished_at"))
    )
    rows = []
    for j in jobs:
        steps = j.job_spec.steps
        by_layer = restarts.get(j.pk, {})
        rows.append(
            {
                "job": j,
                "steps": steps,
                "progress_pct": figures.progress_pct(j),
                "restarts": [
                    (charts.LAYER_NAMES[k], by_layer.get(k, 0))
                    for k in (Layer.IN_PROCESS, Layer.IN_JOB, Layer.JOB)
                ],
                "goodput": j.goodput(now)["goodput"],
                "last_durable_at": durable.get(j.pk),
            }
        )
    return rows


# -- job page parts ----------------------------------------------------------------------------------


def job_bounds(job: Job, now: datetime) -> tuple[float, float]:
    start = (job.started_at or job.created_at).timestamp()
    end = (job.finished_at or now).timestamp()
    return start, max(start, end)


def lanes_for(job: Job, now: datetime) -> list[dict]:
    """One lane per rank, ordered by (node, rank); loaded once per request (timeline and health strip)."""
    cached = getattr(job, "_dashboard_lanes", None)
    if cached is not None:
        return cached
    ranks = {r.rank: r for r in Rank.objects.filter(job=job)}
    job._dashboard_lanes = _rank_lanes(job, now, ranks, sorted(set(range(job.world_size)) | set(ranks)))
    return job._dashboard_lanes


def _rank_lanes(job: Job, now: datetime, ranks: dict[int, Rank], ids: list[int]) -> list[dict]:
    # Each row moved forward to the heartbeat store's newest beat, judged by the watchdog's own rule.
    fresh = figures.freshest(job, ids) if job.is_active and ids else {}
    timeouts = job.timeouts
    lanes = []
    for i in ids:
        r = ranks.get(i)
        if i in fresh:
            r = health.current(r or Rank(job=job, rank=i), fresh[i], timeouts, now)
        lanes.append({"rank": i, "node": r.node if r else "", "row": r})
    lanes.sort(key=lambda ln: (ln["node"], ln["rank"]))
    return lanes


def _within_job(windows: list[dict], start: float, end: float) -> list[dict]:
    """Outage windows clipped to the job's own lifetime (an outage before it existed or after it ended
    is none of its business); those that fall outside it are dropped."""
    out = []
    for w in windows:
        tz = w["start"].tzinfo
        a = max(w["start"].timestamp(), start)
        b = min((w["end"] or datetime.fromtimestamp(end, tz=tz)).timestamp(), end)
        if b > a:
            out.append({**w, "start": datetime.fromtimestamp(a, tz=tz),
                        "end": w["end"] and datetime.fromtimestamp(b, tz=tz)})
    return out


def _cycle_dicts(job: Job, lo: datetime | None = None, hi: datetime | None = None) -> list[dict]:
    """Cycles overlapping [lo, hi] (all without bounds)."""
    qs = RestartCycle.objects.filter(job=job)
    if hi is not None:
        qs = qs.exclude(fault_at__gt=hi)
    if lo is not None:
        qs = qs.filter(Q(first_step_at__gte=lo) | Q(first_step_at__isnull=True))
    out = []
    for c in qs:
        out.append(
            {
                "id": c.pk,
                "command_id": c.command_id,
                "key": c.key,
                "layer": c.layer,
                "title": c.title,
                "reason": c.reason
                + (f" · superseded by {c.escalated_to} (not counted as a restart)" if c.escalated_to else ""),
                "superseded": bool(c.escalated_to),
                "fault_at": ts(c.fault_at),
                "detected_at": ts(c.detected_at),
                "aborted_at": ts(c.aborted_at),
                "restarted_at": ts(c.restarted_at),
                "checkpoint_loaded_at": ts(c.checkpoint_loaded_at),
                "restored_from": c.restored_from,
                "first_step_at": ts(c.first_step_at),
                "start": ts(c.start_at),
                "durations": c.durations(),
                "recovery_s": c.recovery_s,
                "lost_steps": c.lost_steps,
            }
        )
    return out


def timeline_part(
    job: Job,
    now: datetime,
    *,
    start: float | None = None,
    end: float | None = None,
    follow: bool = False,
    node: str | None = None,
) -> dict:
    """The recovery timeline: one lane per rank for a small job (or for one ``node``'s ranks: the
    drill-down), one lane per troubled node and one for the rest for a large one (``fleet.py``)."""
    job_start, job_end = job_bounds(job, now)
    is_open = job.finished_at is None
    if follow or start is None or end is None:
        if follow and is_open:
            span = (
                (end - start) if (start is not None and end is not None and end > start) else FOLLOW_WINDOW_S
            )
            t1 = job_end + 2.0
            t0 = max(job_start - 2.0, t1 - span)
        else:
            pad = max(2.0, (job_end - job_start) * 0.01)
            t0, t1 = job_start - pad, job_end + pad
    else:
        t0, t1 = start, end
    t0, t1 = min(t0, t1 - 1.0), max(t1, t0 + 1.0)
    if node:
        by_rank = fleet.node_ranks(job, node)
        lanes = _rank_lanes(job, now, by_rank, sorted(by_rank))
        mode = "node"
    elif fleet.is_large(job):
        lanes, mode = [], "nodes"
    else:
        lanes, mode = lanes_for(job, now), "ranks"
    in_lanes = {ln["rank"] for ln in lanes}
    margin = timedelta(minutes=10)
    lo = datetime.fromtimestamp(t0, tz=now.tzinfo) - margin
    hi = datetime.fromtimestamp(t1, tz=now.tzinfo)
    cycles = _cycle_dicts(job, lo, hi)
    ck = [
        {"started_at": a, "finished_at": b, "blocking_s": bl, "mode": m, "state": s, "step": st}
        for a, b, bl, m, s, st in Checkpoint.objects.filter(
            job=job, started_at__gte=lo, started_at__lte=hi
        ).values_list(Epoch("started_at"), Epoch("finished_at"), "blocking_s", "mode", "state", "step")
    ]
    # Faults in view, and older ones whose span may still reach into it (open cycle, late detection).
    in_view = (
        Q(at__gte=lo) | Q(detected_at__gte=lo) | Q(cycle__isnull=False, cycle__first_step_at__isnull=True)
    )
    fault_rows = Fault.objects.filter(in_view, job=job, at__lte=hi)
    if mode == "node":
        fault_rows = fault_rows.filter(Q(rank__in=sorted(in_lanes)) | Q(rank__isnull=True))
    fault_rows = list(fault_rows.select_related("cycle").order_by("at", "id"))
    if mode == "nodes":
        ranks = fleet.unhealthy_ranks(job, now)
        nodes = {r["rank"]: r["node"] for r in ranks}
        nodes.update(fleet.rank_nodes(job, {f.rank for f in fault_rows if f.rank is not None} - set(nodes)))
    else:
        nodes = {ln["rank"]: ln["node"] for ln in lanes if ln["node"]}
        windows = outages.grace_windows(now) if job.is_active else []
        # Only lost and stalled make spans (``rank_spans``): stragglers come from the watchdog's marks.
        ranks = [
            {
                "rank": ln["rank"],
                "health": health.judge(ln["row"], now, windows) if ln["row"] else "ok",
                "last_heartbeat_at": ts(ln["row"].last_heartbeat_at) if ln["row"] else None,
                "step_changed_at": ts(ln["row"].step_changed_at) if ln["row"] else None,
            }
            for ln in lanes
        ]
    faults = [fault_dict(f, nodes, end=job.finished_at) for f in fault_rows]
    if not job.is_active:
        ranks = []  # a finished job's ranks are stopped, not dead
    end_ts = job_end
    spans = job_spans(
        start=job_start,
        first_step=ts(job.first_step_at),
        end=end_ts,
        is_open=is_open,
        cycles=cycles,
        checkpoints=ck,
    )
    per_rank = rank_spans(
        end=end_ts, is_open=is_open, faults=faults, cycles_by_id={c["id"]: c for c in cycles}, ranks=ranks
    )
    marks = Event.objects.filter(job=job, kind=STRAGGLER_EVENT, at__lte=hi).order_by("at", "id")
    if mode == "node":
        marks = marks.filter(rank__in=sorted(in_lanes))
    for rank, start, stop in straggler_spans(
        [(r, at, (d or {}).get("state", "")) for r, at, d in marks.values_list("rank", Epoch("at"), "data")], end=t1
    ):
        per_rank.append(Span(start, stop if stop is not None else end_ts, STRAGGLER, rank,
                             f"straggler: rank {rank} slower than the others", open=stop is None and is_open))
    if mode == "nodes":
        nodes.update(fleet.rank_nodes(job, {s.lane for s in per_rank} - set(nodes)))  # stragglers' nodes
        lanes, per_rank = fleet.group_by_node(job, per_rank, faults, nodes, t0, t1)
    spans += per_rank
    commands = [
        {
            "id": c.pk,
            "issued_at": ts(c.issued_at),
            "summary": command_summary(c),
            "by": c.issued_by.get_username() if c.issued_by else "system",
            "status": c.status,
        }
        for c in Command.objects.filter(job=job, issued_at__gte=lo, issued_at__lte=hi).select_related(
            "issued_by"
        )
    ]
    decisions = [
        {"at": at, "rule": (d or {}).get("rule"), "subject": (d or {}).get("subject", ""),
         "why": (d or {}).get("why", ""), "words": ACTION_WORDS.get((d or {}).get("action"), "")}
        for at, d in Event.objects.filter(job=job, kind=POLICY_EVENT, at__gte=lo, at__lte=hi)
        .order_by("at", "id").values_list(Epoch("at"), "data")[:2000]
    ]
    fig = timeline_figure(
        lanes=lanes,
        spans=spans,
        faults=faults,
        cycles=cycles,
        commands=commands,
        decisions=decisions,
        t0=t0,
        t1=t1,
        now=now.timestamp(),
    )
    born = min(job.created_at.timestamp(), job_start)
    add_outage_bands(fig["figure"], _within_job(outages.windows_between(lo, hi), born, job_end), now)
    fig["follow"] = bool(follow and is_open)
    fig["start_ms"] = charts.ms(job_start)
    fig["active"] = is_open
    fig["mode"] = mode
    fig["node"] = node or ""
    fig["large"] = fleet.is_large(job)
    fig["lane_nodes"] = [None] + [ln.get("node") if mode == "nodes" else None for ln in lanes]
    fig["nodes_shown"] = [ln["node"] for ln in lanes if mode == "nodes" and ln.get("node") is not None]
    return fig


def fault_dict(f: Fault, nodes: dict[int, str], *, end: datetime | None = None) -> dict:
    """A fault for the timeline, with its outcome from the one place that computes it. ``end``: the
    job's finish; a fault recorded after it (the launcher seeing the stopped processes exit) is drawn
    at it."""
    return {
        "at": ts(f.at if end is None else min(f.at, end)),
        "detected_at": ts(f.detected_at if end is None else min(f.detected_at, end)),
        "rank": f.rank,
        "fault_class": f.fault_class,
        "cycle_id": f.cycle_id,
        "detected_by": f.detected_by,
        "message": redact(f.message),
        **figures.fault_figures(f, rank_nodes=nodes, ended=end is not None).as_dict(),
    }


def command_summary(c: Command) -> str:
    if c.kind == "restart":
        return f"restart ({charts.LAYER_NAMES.get(c.level, c.level)})" + (
            f" rank {c.rank}" if c.rank is not None else ""
        )
    if c.kind == "inject_fault":
        return f"inject {c.fault} into rank {c.rank}"
    return c.kind


def _checkpoint_rows(job: Job) -> list[tuple]:
    """Every save of the job as plain tuples (epoch floats), loaded once per request: the checkpoint
    chart and the progress chart both read them."""
    rows = getattr(job, "_dashboard_checkpoints", None)
    if rows is None:
        rows = list(
            Checkpoint.objects.filter(job=job)
            .order_by("started_at")
            .values_list(
                Epoch("started_at"),
                Epoch("finished_at"),
                "blocking_s",
                "write_s",
                "bytes",
                "mode",
                "state",
                "step",
                "interference_s",
            )
        )
        job._dashboard_checkpoints = rows
    return rows


def checkpoint_part(job: Job) -> dict:
    rows = []
    for started_at, finished_at, blocking_s, write_s, nbytes, mode, state, step, interf in _checkpoint_rows(job):
        fig = figures.checkpoint_figures(
            started_at=started_at, finished_at=finished_at, state=state, write_s=write_s, nbytes=nbytes
        )
        rows.append(
            {
                "started_at": started_at,
                "step": step,
                "mode": mode,
                "state": state,
                "blocking_s": blocking_s,
                "interference_s": interf,
                "elapsed_s": fig.elapsed_s,
                "durable_s": fig.durable_s,
                "mb_per_s": fig.mb_per_s,
            }
        )
    counts = figures.checkpoint_counts(r["state"] for r in rows)
    advice = figures.checkpoint_mode_advice(
        (r[5], r[6], r[2], r[3], r[8]) for r in _checkpoint_rows(job)
    )
    return {"chart": charts.checkpoint_figure(rows), "counts": counts, "recent": list(reversed(rows[-8:])),
            "total": len(rows), "advice": advice, "mode": (job.spec or {}).get("checkpoint_mode") or "async",
            "min_saves": figures.MIN_ADVICE_SAVES}


FAULT_FILTERS = ("fault_class", "layer", "rank")


def faults_part(job: Job, params) -> dict:
    # Primary faults; each one's consequences and repeats fold under it (``jobs.attribution``).
    qs = Fault.objects.filter(job=job, primary__isnull=True).select_related("cycle").order_by("-at", "-id")
    chosen = {k: params.get(k, "") for k in FAULT_FILTERS}
    if chosen["fault_class"]:
        qs = qs.filter(fault_class=chosen["fault_class"])
    if chosen["layer"]:
        qs = qs.filter(cycle__layer=chosen["layer"])
    if chosen["rank"] not in ("", None):
        try:
            qs = qs.filter(rank=int(chosen["rank"]))
        except ValueError:
            chosen["rank"] = ""
    page = Paginator(qs, FAULTS_PER_PAGE).get_page(params.get("page"))
    nodes = fleet.rank_nodes(job, {f.rank for f in page.object_list if f.rank is not None})
    rows = []
    echoes: dict[int, list[Fault]] = {}
    repeats: dict[int, list[Fault]] = {}
    for e in Fault.objects.filter(primary__in=[f.pk for f in page.object_list]).order_by("at", "id"):
        (repeats if e.link == "repeat" else echoes).setdefault(e.primary_id, []).append(e)
    for f in page.object_list:
        fig = figures.fault_figures(f, rank_nodes=nodes, ended=not job.is_active)
        rows.append(
            {
                "f": f,
                "at": f.at if job.finished_at is None else min(f.at, job.finished_at),
                "message": redact(f.message),
                "node": fig.node,
                "layer": layer_words(fig.layer, fig.escalated_to),
                "detection": charts.fmt_s(fig.detection_s),
                "recovery": recovery_words(fig),
                "lost": fig.lost_steps,
                "echoes": [e.why for e in echoes.get(f.pk, [])],
                "times": [x.at for x in repeats.get(f.pk, [])],
            }
        )
    if not chosen["fault_class"] and chosen["rank"] in ("", None):
        rows = sorted(rows + _restart_rows(job, page, chosen["layer"]), key=lambda r: r["at"], reverse=True)
    classes = sorted(set(Fault.objects.filter(job=job).values_list("fault_class", flat=True).distinct()))
    spec = job.job_spec
    return {
        "next": policy.what_next(job),
        "rules": [f"{i + 1}. {r.words()}" for i, r in enumerate(spec.failure_policy)],
        "page": page,
        "rows": rows,
        "chosen": chosen,
        "classes": classes,
        "layers": [(v.value, charts.LAYER_NAMES[v.value]) for v in Layer],
        # A large job's rank filter is a number field, not 100,000 options.
        "ranks": None if fleet.is_large(job) else range(job.world_size),
    }


def _restart_rows(job: Job, page, layer: str) -> list[dict]:
    """The operator's restarts on this page of the fault table (between its oldest and newest fault): an
    action, not a fault, with the cycle's figures and its phases (deliver, detect, ...) in the hover."""
    cycles = (RestartCycle.objects.filter(job=job, command__kind="restart")
              .select_related("command__issued_by"))
    if layer:
        cycles = cycles.filter(layer=layer)
    faults = list(page.object_list)
    if faults and page.has_previous():
        cycles = cycles.filter(fault_at__lte=faults[0].at)
    if faults and page.has_next():
        cycles = cycles.filter(fault_at__gt=faults[-1].at)
    rows = []
    for c in cycles.order_by("-fault_at")[:FAULTS_PER_PAGE]:
        if c.start_at is None:
            continue
        who = c.command.issued_by.get_username() if c.command.issued_by else "system"
        recovering = c.recovery_s is None and job.is_active
        rows.append({
            "action": True,
            "at": c.start_at if job.finished_at is None else min(c.start_at, job.finished_at),
            "summary": f"{command_summary(c.command)} asked for by {who}",
            "layer": layer_words(c.layer, c.escalated_to),
            "detection": "–",
            "recovery": charts.fmt_s(c.recovery_s) if c.recovery_s is not None else (
                "in progress" if recovering else "–"),
            "breakdown": " · ".join(f"{k.replace('_', ' ')} {charts.fmt_s(v)}"
                                    for k, v in c.durations().items()),
            "lost": c.lost_steps,
        })
    return rows


def layer_words(layer: str | None, escalated_to: str | None = None) -> str:
    if not layer:
        return ""
    return charts.LAYER_NAMES.get(layer, layer) + (" → handed on to a later restart" if escalated_to else "")


def recovery_words(o) -> str:
    if o.recovery_s is not None:
        return charts.fmt_s(o.recovery_s)
    return "in progress" if o.recovering else "–"


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


def goodput_part(job: Job, now: datetime) -> dict:
    g = job.goodput(now)
    parts = [
        {
            "key": k,
            "label": GOODPUT_LABELS[k],
            "share": g[k],
            "pct": round(100 * g[k], 1),
            "seconds": charts.fmt_s(g[f"{k}_s"]),
            "color": GOODPUT_COLORS[k],
        }
        for k in PARTS
    ]
    fig = {
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
                **charts.BASE_LAYOUT,
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
    return {
        "g": g,
        "parts": parts,
        "wall": charts.fmt_s(g["wall_s"]),
        "goodput_pct": round(100 * g["goodput"], 1),
        "chart": fig,
    }


def ranks_part(job: Job, now: datetime, params=None) -> dict:
    """A chip and a table row per rank; a large job's part is a heatmap and pages (``fleet.py``)."""
    if fleet.is_large(job):
        out = fleet.ranks_part(job, now, params or {})
        out["quarantined"] = _quarantined(job)
        return out
    lanes = lanes_for(job, now)
    rows = []
    for f in figures.rank_figures(job, [ln["row"] or (ln["rank"], None) for ln in lanes], now):
        rows.append(
            {
                "rank": f.rank,
                "node": f.node,
                "health": "waiting" if f.health == figures.UNKNOWN else f.health,
                "age": now.timestamp() - f.hb_at if f.hb_at else None,
                "hb_at": f.hb_at,
                "hb_ms": int(f.hb_at * 1000) if f.hb_at else None,
                "phase": f.phase,
                "step": f.step,
                "loss": f.loss,
                "step_time_s": f.step_time_s,
                "busy_s": f.busy_s,
                "slowdown_pct": f.slowdown_pct,
                "pid": f.pid,
                "why": _why_no_heartbeat(job) if f.health == figures.UNKNOWN else "",
            }
        )
    return {"rows": rows, "now": now.timestamp(), "quarantined": _quarantined(job)}


def _quarantined(job: Job) -> list:
    return list(QuarantinedHeartbeat.objects.filter(job=job).order_by("-at")[:QUARANTINE_SHOWN])


QUARANTINE_SHOWN = 10


def _why_no_heartbeat(job: Job) -> str:
    why = "the job has not started training" if job.is_active else "it never reported"
    return f"no heartbeat yet: {why}"


SAMPLES_SHOWN = 20_000  # the newest samples (about 11 hours at one per 2 s); older ones are not drawn


def progress_part(job: Job, now: datetime) -> dict:
    samples = list(
        TrainingSample.objects.filter(job=job)
        .order_by("-at")
        .values_list(Epoch("at"), "step", "loss", "tokens_per_s", "step_time_s")[:SAMPLES_SHOWN]
    )
    samples.reverse()
    points: list[tuple[float, int]] = [(t, step) for t, step, _, _, _ in samples]
    if job.first_step_at:
        points.append((job.first_step_at.timestamp(), 1))
    points += [(r[0], r[7]) for r in _checkpoint_rows(job)]
    for fault_at, step_at_fault, first_at, resumed in RestartCycle.objects.filter(job=job).values_list(
        Epoch("fault_at"), "step_at_fault", Epoch("first_step_at"), "resumed_from_step"
    ):
        if fault_at is not None and step_at_fault is not None:
            points.append((fault_at, step_at_fault))
        if first_at is not None and resumed is not None:
            points.append((first_at, resumed))
    if job.last_progress_at:
        points.append((job.last_progress_at.timestamp(), job.last_step))
    points.sort()
    loss = charts.loss_figure([(t, loss, tps) for t, _, loss, tps, _ in samples])
    return {
        "progress": charts.progress_figure(points, [(t, st) for t, _, _, _, st in samples]),
        "loss": loss,
        "has_samples": loss is not None,
        "has_progress": bool(points),
        "reported": [name for name, i in (("loss", 2), ("tokens/s", 3))
                     if any(r[i] is not None for r in samples)],
        "ended": not job.is_active,
    }


def commands_part(job: Job) -> dict:
    cmds = list(Command.objects.filter(job=job).select_related("issued_by")[:30])
    return {"commands": [{"c": c, "summary": command_summary(c)} for c in cmds]}


def audit_part(job: Job) -> dict:
    return {"entries": list(AuditEntry.objects.filter(job=job)[:30])}


def log_part(job: Job) -> dict:
    tail = log_tail(job)
    if tail.text is None:
        return {"available": False, "why": tail.why}
    return {"available": True, "text": tail.text}
