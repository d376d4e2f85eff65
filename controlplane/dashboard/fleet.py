"""The job page of a large job (more ranks than ``MAX_RANK_LANES``): node lanes and a heartbeat heatmap.

A small job's page draws one timeline lane and one health chip per rank. At 100,000 ranks that is
unreadable and costs seconds of Python per request, so past ``MAX_RANK_LANES`` the page changes shape:

- the timeline draws one lane per node that has rank-level phases or faults in view (the most
  alarming first, up to ``MAX_RANK_LANES - 1``) and folds every other node into one lane; a node lane
  shows its ranks' spans, the worst phase on top. ``?node=<name>`` drills down to that node's ranks.
- rank health is a heatmap of heartbeat age (node x local rank, nodes binned down to ``MAX_HEAT_ROWS``
  rows), aggregated in SQL; the worst ranks (lost, stalled, silent, slowest) are listed first, and
  every rank is reachable through a paginated table.

Nothing here loads every rank: the per-request work is a few aggregates and bounded queries
(``LIMIT``), and only the ranks shown are moved forward to the heartbeat store's newest beat
(``rank_health.current``). Accepted trade-offs: the heatmap's ages and the counts come from the stored rows,
which trail the Redis store by at most one flush (``HEARTBEAT_FLUSH_INTERVAL_S``); a straggler is the
watchdog's mark (``Rank.straggler_at``) with the slowdown its mark recorded, not recomputed against the
median of every rank per request.
"""

from __future__ import annotations

import math
from datetime import datetime

from django.conf import settings
from django.core.paginator import Paginator
from django.db.models import Case, Count, F, Min, Q, Value, When

from controlplane.dashboard.plots.downsample import PRIORITY
from controlplane.dashboard.plots.style import BASE_LAYOUT
from controlplane.dashboard.timeline import Span
from controlplane.dashboard.words import fmt_s
from controlplane.jobs import outages, rank_health, readouts
from controlplane.jobs.goodput import Epoch
from controlplane.jobs.models import Event, Job, Rank, RankHealth
from controlplane.jobs.stragglers import STRAGGLER_EVENT
from trainer.wire import Phase

MAX_RANK_LANES = 64  # past this many ranks, the timeline groups by node and health becomes a heatmap
MAX_HEAT_ROWS = 250  # heatmap rows (nodes binned together past this)
MAX_HEAT_COLS = 64  # heatmap columns (local ranks binned together past this: a node of very many ranks)
WORST_SHOWN = 20
RANKS_PER_PAGE = 25
MAX_UNHEALTHY = 2000  # lost or stalled ranks drawn on the timeline (the heatmap counts them all)
OTHER_LANE = "other"


def is_large(job: Job) -> bool:
    return job.world_size > MAX_RANK_LANES


def per_node(job: Job) -> int:
    return max(1, int((job.spec or {}).get("procs_per_node", 1)))


def num_nodes(job: Job) -> int:
    return max(1, int((job.spec or {}).get("nodes", 1)))


# -- what the stored rows say, in SQL (``Rank.health_at`` without the store's newer beats) ------------


def lost_q(now: datetime) -> Q:
    return ~Q(phase=Phase.STOPPED) & (Q(lost_at__isnull=False) | Q(stale_at__lt=now))


def stalled_q(now: datetime) -> Q:
    return ~Q(phase=Phase.STOPPED) & ~lost_q(now) & (Q(stalled_at__isnull=False) | Q(stall_at__lt=now))


def moved_forward(job: Job, rows: list[Rank], now: datetime) -> list[Rank]:
    """``rows`` with the heartbeat store's newest beats (the watchdog's own rule)."""
    fresh = readouts.freshest(job, [r.rank for r in rows]) if job.is_active and rows else {}
    timeouts = job.timeouts
    return [rank_health.current(r, fresh.get(r.rank), timeouts, now) for r in rows]


def troubled(job: Job, now: datetime) -> list[Rank]:
    """Ranks whose rows say lost, stalled or never beat (at most ``MAX_UNHEALTHY``): lost first, then
    stalled, then silent since the start, oldest heartbeat first within each. One query per request,
    shared by the timeline and the worst-ranks list."""
    cached = getattr(job, "_fleet_troubled", None)
    if cached is None or cached[0] != now:
        badness = Case(When(lost_q(now), then=Value(0)), When(stalled_q(now), then=Value(1)), default=Value(2))
        rows = list(
            Rank.objects.filter(lost_q(now) | stalled_q(now) | Q(last_heartbeat_at__isnull=True), job=job)
            .annotate(bad=badness)
            .order_by("bad", F("last_heartbeat_at").asc(nulls_last=True), "rank")[:MAX_UNHEALTHY]
        )
        cached = job._fleet_troubled = (now, rows)
    return cached[1]


def unhealthy_ranks(job: Job, now: datetime) -> list[dict]:
    """Lost and stalled ranks (at most ``MAX_UNHEALTHY``), as ``timeline.rank_spans`` wants them.

    Candidates come from the rows; a newer beat in the store only moves a rank's deadlines later, so
    judging just the candidates with it finds every rank the page would judge lost or stalled."""
    if not job.is_active:
        return []
    rows = [r for r in troubled(job, now) if r.bad < 2]
    windows = outages.grace_windows(now)
    out = []
    for r in moved_forward(job, rows, now):
        h = rank_health.judge(r, now, windows)
        if h in (RankHealth.LOST, RankHealth.STALLED):
            out.append({"rank": r.rank, "node": r.node, "health": h,
                        "last_heartbeat_at": r.last_heartbeat_at.timestamp() if r.last_heartbeat_at else None,
                        "step_changed_at": r.step_changed_at.timestamp() if r.step_changed_at else None})
    return out


# -- timeline: node lanes ------------------------------------------------------------------------------


def node_lanes(job: Job, severity: dict[str, int]) -> tuple[list[dict], set[str]]:
    """Lanes for a large job: the ``MAX_RANK_LANES - 1`` most alarming nodes (``severity``: node ->
    rank, lower is worse), by name, then one lane for every other node. Returns (lanes, shown nodes)."""
    picked = sorted(severity, key=lambda n: (severity[n], n))[: MAX_RANK_LANES - 1]
    shown = set(picked)
    lanes = [{"key": f"node:{n}", "node": n, "label": n or "(no node named yet)"} for n in sorted(picked)]
    others = num_nodes(job) - len([n for n in picked if n])
    if others > 0:
        lanes.append({"key": OTHER_LANE, "node": None,
                      "label": f"{others:,} other node{'s' if others != 1 else ''}"})
    return lanes, shown


def lane_key(node: str, shown: set[str]) -> str:
    return f"node:{node}" if node in shown else OTHER_LANE


def group_by_node(
    job: Job, per_rank: list[Span], faults: list[dict], nodes: dict[int, str], t0: float, t1: float
) -> tuple[list[dict], list[Span]]:
    """A large job's lanes: a lane per node with rank-level phases or faults in view (the most alarming
    first, ``node_lanes``), every other node in one; each span and fault moves to its node's lane
    and names its rank and node (hover)."""
    order = {p: i for i, p in enumerate(PRIORITY)}
    severity: dict[str, int] = {}
    for s in per_rank:
        if s.end >= t0 and s.start <= t1:
            n = nodes.get(s.lane, "")
            severity[n] = min(severity.get(n, len(order)), order.get(s.phase, len(order)))
    for f in faults:
        if f["rank"] is not None and t0 <= f["at"] <= t1:
            n = f["node"] or nodes.get(f["rank"], "")
            severity[n] = min(severity.get(n, len(order) + 1), len(order))
    lanes, shown = node_lanes(job, severity)
    moved = [
        Span(s.start, s.end, s.phase, lane_key(nodes.get(s.lane, ""), shown),
             f"rank {s.lane} on {nodes.get(s.lane) or 'a node not named yet'}: {s.label}", s.open)
        for s in per_rank
    ]
    for f in faults:
        if f["rank"] is not None:
            f["lane"] = lane_key(f["node"] or nodes.get(f["rank"], ""), shown)
    return lanes, moved


def node_ranks(job: Job, node: str) -> dict[int, Rank]:
    return {r.rank: r for r in Rank.objects.filter(job=job, node=node)}


def rank_nodes(job: Job, ranks: set[int]) -> dict[int, str]:
    if not ranks:
        return {}
    return dict(Rank.objects.filter(job=job, rank__in=sorted(ranks)).values_list("rank", "node"))


# -- rank health: heatmap, worst ranks, pages ------------------------------------------------------------


def heatmap(job: Job, now: datetime) -> dict:
    """Heartbeat age by node (rows: torchrun's node rank, ``rank // procs_per_node``, binned down to
    ``MAX_HEAT_ROWS``) and local rank (columns); a cell is its ranks' oldest heartbeat. One aggregate."""
    ppn, nodes = per_node(job), num_nodes(job)
    per_row = max(1, math.ceil(nodes / MAX_HEAT_ROWS))
    rows = math.ceil(nodes / per_row)
    per_col = max(1, math.ceil(ppn / MAX_HEAT_COLS))
    cols = math.ceil(ppn / per_col)
    cells = (
        Rank.objects.filter(job=job)
        # Integer arithmetic on both databases (SQLite's MOD returns a float: its quotient would not group).
        .annotate(hr=F("rank") / (ppn * per_row), lr=(F("rank") - F("rank") / ppn * ppn) / per_col)
        .values("hr", "lr")
        .annotate(oldest=Epoch(Min("last_heartbeat_at")), n=Count("id"),
                  never=Count("id", filter=Q(last_heartbeat_at__isnull=True)),
                  lost=Count("id", filter=lost_q(now)), stalled=Count("id", filter=stalled_q(now)),
                  slow=Count("id", filter=Q(straggler_at__isnull=False) & ~lost_q(now)))
        .order_by()
        .values_list("hr", "lr", "oldest", "n", "never", "lost", "stalled", "slow")
    )
    z: list[list[float | None]] = [[None] * cols for _ in range(rows)]
    text = [["no rank has reported"] * cols for _ in range(rows)]
    counts = {"ranks": 0, "lost": 0, "stalled": 0, "never": 0, "stragglers": 0}
    t = now.timestamp()
    for hr, lr, oldest, n, never, lost, stalled, slow in cells:
        counts["ranks"] += n
        counts["lost"] += lost
        counts["stalled"] += stalled
        counts["never"] += never
        counts["stragglers"] += slow
        i, j = int(hr), int(lr)
        if not (0 <= i < rows and 0 <= j < cols):
            continue  # a rank beyond the job's world (reported, but not in the spec)
        age = max(0.0, t - oldest) if oldest is not None else None
        # A cell is as bad as its worst rank: a lost one shows its age (red); otherwise a rank that never
        # beat leaves the cell grey (a gap) rather than green from its neighbours' fresh beats.
        z[i][j] = round(age, 1) if age is not None and (lost or not never) else None
        words = f"oldest heartbeat {fmt_s(age)} ago" if age is not None else "no heartbeat yet"
        if lost or stalled or never or slow:
            words += "".join(f" · {k} {w}" for k, w in ((lost, "lost"), (stalled, "stalled"),
                                                        (never, "never beat"), (slow, "straggler")) if k)
        where = "" if per_col == 1 else f"local ranks {j * per_col}–{min(ppn, (j + 1) * per_col) - 1}: "
        text[i][j] = f"{where}{words} ({n} rank{'s' if n != 1 else ''})"
    labels = [_row_label(i, per_row, nodes) for i in range(rows)]
    step_s = job.timeouts.step_s
    fig = {
        "figure": {
            "data": [{
                "type": "heatmap", "z": z, "customdata": text, "y": list(range(rows)), "x": list(range(cols)),
                "zmin": 0, "zmax": step_s, "zauto": False,
                # ok → late (half-way to the deadline) → lost (the step timeout)
                "colorscale": [[0, "#9ad0a6"], [0.5, "#edc948"], [1, "#c0392b"]],
                "colorbar": {"title": {"text": "s since<br>heartbeat"}, "thickness": 12},
                "xgap": 1, "ygap": 0 if rows > 60 else 1, "hoverongaps": False,
                "text": [[labels[i]] * cols for i in range(rows)],
                "hovertemplate": ("<b>%{text}</b>, local rank %{x}<br>%{customdata}<extra></extra>" if per_col == 1 else
                                  "<b>%{text}</b><br>%{customdata}<extra></extra>"),
            }],
            "layout": {
                **BASE_LAYOUT, "height": max(200, min(520, 40 + rows * 3)), "uirevision": "heat",
                "plot_bgcolor": "#c9c9c9",  # gaps: no heartbeat yet
                "margin": {"l": 90, "r": 10, "t": 10, "b": 40},
                "xaxis": {"title": {"text": "local rank" if per_col == 1 else f"local ranks ({per_col} per column)"},
                          **({"dtick": 1} if cols <= 16 else {}), "fixedrange": True},
                "yaxis": {"autorange": "reversed", "tickvals": _ticks(rows),
                          "ticktext": [labels[i] for i in _ticks(rows)], "tickfont": {"size": 10}},
            },
        }
    }
    counts["ok"] = counts["ranks"] - counts["lost"] - counts["stalled"] - counts["never"] - counts["stragglers"]
    return {"chart": fig, "rows": rows, "cols": cols, "ppn": ppn, "ranks_per_col": per_col, "nodes_per_row": per_row,
            "counts": counts,
            "flush_s": settings.HEARTBEAT_FLUSH_INTERVAL_S, "step_s": step_s}


def _row_label(i: int, per_row: int, nodes: int) -> str:
    a, b = i * per_row, min(nodes, (i + 1) * per_row) - 1
    return f"node {a}" if a == b else f"nodes {a}–{b}"


def _ticks(rows: int) -> list[int]:
    step = max(1, math.ceil(rows / 25))
    return list(range(0, rows, step))


def straggler_slowdowns(job: Job, ranks: list[int]) -> dict[int, float]:
    """{rank: slowdown in percent} of the given ranks the watchdog marked stragglers (``Rank.straggler_at``),
    from its newest mark (``jobs/stragglers.py`` writes the figure into the mark's event)."""
    if not ranks:
        return {}
    marks = (Event.objects.filter(job=job, kind=STRAGGLER_EVENT, rank__in=sorted(ranks)).order_by("at", "id")
             .values_list("rank", "data"))
    out: dict[int, float] = {}
    for rank, data in marks:
        if (data or {}).get("state") == "marked" and isinstance((data or {}).get("slowdown_pct"), int | float):
            out[rank] = float(data["slowdown_pct"])
    return out


def rank_rows(job: Job, rows: list[Rank], now: datetime) -> list[dict]:
    """The rank table's rows for ``rows`` (moved forward to the store's newest beats). A straggler is the
    watchdog's mark: comparing with the median of 100,000 ranks per request is what the watchdog already
    does once per pass."""
    windows = outages.grace_windows(now) if job.is_active else []
    slow = straggler_slowdowns(job, [r.rank for r in rows if r.straggler_at is not None])
    t = now.timestamp()
    out = []
    for r in moved_forward(job, rows, now):
        pct = slow.get(r.rank) if r.straggler_at is not None else None
        if pct is None and r.straggler_at is not None:
            pct = 0.0
        h = rank_health.judge(r, now, windows, pct) if job.is_active else "stopped"
        if r.last_heartbeat_at is None and job.is_active:
            h = "waiting"
        hb = r.last_heartbeat_at.timestamp() if r.last_heartbeat_at else None
        out.append({"rank": r.rank, "node": r.node, "health": h, "age": t - hb if hb else None, "hb_at": hb,
                    "hb_ms": int(hb * 1000) if hb else None, "phase": r.phase, "step": r.last_step,
                    "loss": r.loss, "step_time_s": r.step_time_s, "busy_s": r.busy_s,
                    "slowdown_pct": pct if h == RankHealth.STRAGGLER else None,
                    "pid": r.pid, "why": "" if hb else "no heartbeat yet"})
    return out


SLOWEST_SHOWN = 5  # the slowest ranks listed after the silent ones (at most WORST_SHOWN - 5 of those)


def worst_ranks(job: Job, now: datetime) -> list[dict]:
    """The worst ranks, silent first: lost, then stalled, then those that never beat (oldest heartbeat
    first within each), then the ``SLOWEST_SHOWN`` slowest (largest own work per step)."""
    silent = troubled(job, now)[: WORST_SHOWN - SLOWEST_SHOWN]
    seen = {r.rank for r in silent}
    slow = [r for r in Rank.objects.filter(job=job, phase=Phase.TRAIN, busy_s__isnull=False)
            .exclude(lost_q(now)).order_by("-busy_s", "rank")[:WORST_SHOWN] if r.rank not in seen]
    return rank_rows(job, silent + slow[:SLOWEST_SHOWN], now)


class _Counted:
    """A queryset whose count is already known (the heatmap's aggregate counted every rank): the
    paginator slices it without a count query of its own."""

    def __init__(self, qs, count: int):
        self.qs, self.n = qs, count

    def count(self) -> int:
        return self.n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, k):
        return self.qs[k]


def ranks_part(job: Job, now: datetime, params) -> dict:
    """Rank health of a large job: the heatmap, the worst ranks, one page of every rank by number."""
    node = (params.get("rnode") or "").strip()
    heat = heatmap(job, now)
    qs = Rank.objects.filter(job=job).order_by("rank")
    if node:
        qs = qs.filter(node=node)
    page = Paginator(qs if node else _Counted(qs, heat["counts"]["ranks"]), RANKS_PER_PAGE).get_page(
        params.get("rpage"))
    return {
        "large": True,
        "heat": heat,
        "worst": worst_ranks(job, now),
        "page": page,
        "rows": rank_rows(job, list(page.object_list), now),
        "node": node,
        "now": now.timestamp(),
    }
