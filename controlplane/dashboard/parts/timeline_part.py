"""The recovery timeline part: the window shown, the cycles, saves, faults, spans, commands and policy
decisions in it, drawn by ``plots.recovery_timeline`` with the outage bands on top."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db.models import Q

from controlplane.dashboard import fleet
from controlplane.dashboard.parts.lanes import job_bounds, lanes_for, rank_lanes
from controlplane.dashboard.plots.outage_bands import add_outage_bands
from controlplane.dashboard.plots.recovery_timeline import timeline_figure
from controlplane.dashboard.plots.style import ms
from controlplane.dashboard.timeline import STRAGGLER, Span, job_spans, rank_spans, ts
from controlplane.dashboard.words import command_summary
from controlplane.jobs import outages, rank_health, readouts
from controlplane.jobs.goodput import Epoch
from controlplane.jobs.models import Checkpoint, Command, Event, Fault, Job, RestartCycle
from controlplane.jobs.policy import POLICY_EVENT
from controlplane.jobs.stragglers import STRAGGLER_EVENT, straggler_spans
from trainer.policy_rules import ACTION_WORDS
from trainer.wire import redact

FOLLOW_WINDOW_S = 600.0


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
    t0, t1 = _window(job_start, job_end, is_open, start, end, follow)
    lanes, mode = _lanes(job, now, node)
    in_lanes = {ln["rank"] for ln in lanes}
    margin = timedelta(minutes=10)
    lo = datetime.fromtimestamp(t0, tz=now.tzinfo) - margin
    hi = datetime.fromtimestamp(t1, tz=now.tzinfo)
    cycles = _cycle_dicts(job, lo, hi)
    fault_rows = _faults_in_view(job, lo, hi, in_lanes if mode == "node" else None)
    nodes, ranks = _nodes_and_ranks(job, now, lanes, fault_rows, large=mode == "nodes")
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
        checkpoints=_checkpoint_dicts(job, lo, hi),
    )
    per_rank = rank_spans(
        end=end_ts, is_open=is_open, faults=faults, cycles_by_id={c["id"]: c for c in cycles}, ranks=ranks
    )
    per_rank += _straggler_spans(job, hi, t1, end_ts, is_open, in_lanes if mode == "node" else None)
    if mode == "nodes":
        nodes.update(fleet.rank_nodes(job, {s.lane for s in per_rank} - set(nodes)))  # stragglers' nodes
        lanes, per_rank = fleet.group_by_node(job, per_rank, faults, nodes, t0, t1)
    spans += per_rank
    fig = timeline_figure(
        lanes=lanes,
        spans=spans,
        faults=faults,
        cycles=cycles,
        commands=_command_dicts(job, lo, hi),
        decisions=_decision_dicts(job, lo, hi),
        t0=t0,
        t1=t1,
        now=now.timestamp(),
    )
    born = min(job.created_at.timestamp(), job_start)
    add_outage_bands(fig["figure"], _within_job(outages.windows_between(lo, hi), born, job_end), now)
    fig["follow"] = bool(follow and is_open)
    fig["start_ms"] = ms(job_start)
    fig["active"] = is_open
    fig["mode"] = mode
    fig["node"] = node or ""
    fig["large"] = fleet.is_large(job)
    fig["lane_nodes"] = [None] + [ln.get("node") if mode == "nodes" else None for ln in lanes]
    fig["nodes_shown"] = [ln["node"] for ln in lanes if mode == "nodes" and ln.get("node") is not None]
    return fig


def _window(job_start: float, job_end: float, is_open: bool, start: float | None, end: float | None,
            follow: bool) -> tuple[float, float]:
    """The times shown: the asked-for window; following a running job, its last ``FOLLOW_WINDOW_S`` (or the
    asked-for width) up to now; else the whole job, padded. Never under a second wide."""
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
    return min(t0, t1 - 1.0), max(t1, t0 + 1.0)


def _lanes(job: Job, now: datetime, node: str | None) -> tuple[list[dict], str]:
    """The rank lanes and the mode: one ``node``'s ranks, none yet for a large job (its node lanes come
    from the spans, ``fleet.group_by_node``), or every rank."""
    if node:
        by_rank = fleet.node_ranks(job, node)
        return rank_lanes(job, now, by_rank, sorted(by_rank)), "node"
    if fleet.is_large(job):
        return [], "nodes"
    return lanes_for(job, now), "ranks"


def _checkpoint_dicts(job: Job, lo: datetime, hi: datetime) -> list[dict]:
    return [
        {"started_at": a, "finished_at": b, "blocking_s": bl, "mode": m, "state": s, "step": st}
        for a, b, bl, m, s, st in Checkpoint.objects.filter(
            job=job, started_at__gte=lo, started_at__lte=hi
        ).values_list(Epoch("started_at"), Epoch("finished_at"), "blocking_s", "mode", "state", "step")
    ]


def _faults_in_view(job: Job, lo: datetime, hi: datetime, only_ranks: set[int] | None) -> list[Fault]:
    """Faults in view, and older ones whose span may still reach into it (open cycle, late detection);
    with ``only_ranks`` (a node's drill-down), those of its ranks and the rank-less ones."""
    in_view = (
        Q(at__gte=lo) | Q(detected_at__gte=lo) | Q(cycle__isnull=False, cycle__first_step_at__isnull=True)
    )
    fault_rows = Fault.objects.filter(in_view, job=job, at__lte=hi)
    if only_ranks is not None:
        fault_rows = fault_rows.filter(Q(rank__in=sorted(only_ranks)) | Q(rank__isnull=True))
    return list(fault_rows.select_related("cycle").order_by("at", "id"))


def _nodes_and_ranks(job: Job, now: datetime, lanes: list[dict], fault_rows: list[Fault], *,
                     large: bool) -> tuple[dict[int, str], list[dict]]:
    """Each rank's node (for the faults' hovers) and the ranks' health for ``rank_spans``: a large job's
    unhealthy ranks only (``fleet.py``), else every lane's rank judged with the outage grace."""
    if large:
        ranks = fleet.unhealthy_ranks(job, now)
        nodes = {r["rank"]: r["node"] for r in ranks}
        nodes.update(fleet.rank_nodes(job, {f.rank for f in fault_rows if f.rank is not None} - set(nodes)))
        return nodes, ranks
    nodes = {ln["rank"]: ln["node"] for ln in lanes if ln["node"]}
    windows = outages.grace_windows(now) if job.is_active else []
    # Only lost and stalled make spans (``rank_spans``): stragglers come from the watchdog's marks.
    ranks = [
        {
            "rank": ln["rank"],
            "health": rank_health.judge(ln["row"], now, windows) if ln["row"] else "ok",
            "last_heartbeat_at": ts(ln["row"].last_heartbeat_at) if ln["row"] else None,
            "step_changed_at": ts(ln["row"].step_changed_at) if ln["row"] else None,
        }
        for ln in lanes
    ]
    return nodes, ranks


def _straggler_spans(job: Job, hi: datetime, t1: float, end_ts: float, is_open: bool,
                     only_ranks: set[int] | None) -> list[Span]:
    """The watchdog's straggler marks as spans, one per time a rank was slower than the others."""
    marks = Event.objects.filter(job=job, kind=STRAGGLER_EVENT, at__lte=hi).order_by("at", "id")
    if only_ranks is not None:
        marks = marks.filter(rank__in=sorted(only_ranks))
    return [
        Span(start, stop if stop is not None else end_ts, STRAGGLER, rank,
             f"straggler: rank {rank} slower than the others", open=stop is None and is_open)
        for rank, start, stop in straggler_spans(
            [(r, at, (d or {}).get("state", ""))
             for r, at, d in marks.values_list("rank", Epoch("at"), "data")],
            end=t1,
        )
    ]


def _command_dicts(job: Job, lo: datetime, hi: datetime) -> list[dict]:
    return [
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


def _decision_dicts(job: Job, lo: datetime, hi: datetime) -> list[dict]:
    """The failure policy's decisions in view (at most 2,000), in the words the fault table uses."""
    return [
        {"at": at, "rule": (d or {}).get("rule"), "subject": (d or {}).get("subject", ""),
         "why": (d or {}).get("why", ""), "words": ACTION_WORDS.get((d or {}).get("action"), "")}
        for at, d in Event.objects.filter(job=job, kind=POLICY_EVENT, at__gte=lo, at__lte=hi)
        .order_by("at", "id").values_list(Epoch("at"), "data")[:2000]
    ]


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
        **readouts.fault_figures(f, rank_nodes=nodes, ended=end is not None).as_dict(),
    }
