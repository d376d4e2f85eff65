"""Downsampling: each figure keeps a bounded number of marks whatever the job's length. Checkpoint points
keep the failures and each bucket's spikes; the timeline's lanes of many spans become bins of the most
alarming phase."""

from __future__ import annotations

from collections import defaultdict

from controlplane.dashboard.timeline import (
    CHECKPOINT_LOAD,
    CHECKPOINT_SAVE,
    DEAD,
    HUNG,
    RESTARTING,
    STARTING,
    STRAGGLER,
    TRAINING,
    Span,
)
from controlplane.dashboard.words import fmt_s

MAX_POINTS = 600
MAX_SPANS = 400  # per lane (job-wide counts as one lane)
MAX_BINS = 600
# When a bin holds several phases, the most alarming wins; a save must cover a quarter of the bin.
PRIORITY = (DEAD, HUNG, RESTARTING, CHECKPOINT_LOAD, STARTING, STRAGGLER, CHECKPOINT_SAVE)
MIN_COVER = {CHECKPOINT_SAVE: 0.25}


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
        # Bins a span covers whole are counted once per span at their ends (a running sum below), so a
        # lane of thousands of long spans (a node-lost storm) costs spans + bins, not spans x bins.
        full: dict[str, list[int]] = defaultdict(lambda: [0] * (bins + 1))
        open_phases: set[str] = set()
        for s in items:
            if s.open:
                open_phases.add(s.phase)
            i0 = min(bins - 1, int((s.start - t0) / width))
            i1 = min(bins - 1, int((s.end - t0) / width))
            row = cover[s.phase]
            for i in (i0, i1) if i1 > i0 else (i0,):
                a = max(s.start, t0 + i * width)
                b = min(s.end, t0 + (i + 1) * width)
                row[i] += max(b - a, 1e-9)
            if i1 - i0 > 1:
                f = full[s.phase]
                f[i0 + 1] += 1
                f[i1] -= 1
        for phase, f in full.items():
            row, k = cover[phase], 0
            for i in range(bins):
                k += f[i]
                if k:
                    row[i] += k * width
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
