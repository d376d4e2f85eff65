"""Phase spans for the recovery timeline, derived from stored facts (no heartbeat history needed).

Representation (the design choice): heartbeats are not stored as history, so a rank's phases are
rebuilt from the rows that are: restart-cycle marks, checkpoint rows, faults and each rank's latest
state. Most phases are job-wide (every rank saves, every rank restarts), so a span is either

- job-wide (``lane is None``): drawn once across all rank lanes: starting, training, checkpoint save
  (the blocked part of a save), restarting (detect → abort → restart, and the first step after
  the reload), checkpoint load (restart → checkpoint loaded);
- per-rank (``lane == rank``): hung or dead, from the fault on that rank until its cycle aborted /
  restarted it, and from the rank's latest facts (lost → dead since its last heartbeat; stalled →
  hung since its step last moved).

A 64-rank job with 2,000 saves therefore costs ~2,000 job-wide spans, not 128,000, and the
chart downsamples further (``plots.downsample.downsample_spans``). Times are unix seconds (floats).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.wire import FaultClass, RestoredFrom

STARTING = "starting"
TRAINING = "training"
CHECKPOINT_SAVE = "checkpoint save"
CHECKPOINT_LOAD = "checkpoint load"
RESTARTING = "restarting"
HUNG = "hung"
DEAD = "dead"
STRAGGLER = "straggler"  # per rank: marked by the watchdog until it recovered (jobs/stragglers.py)
PHASES = (TRAINING, STARTING, CHECKPOINT_SAVE, CHECKPOINT_LOAD, RESTARTING, STRAGGLER, HUNG, DEAD)

DEAD_CLASSES = frozenset(
    {
        FaultClass.PROCESS_KILLED,
        FaultClass.NODE_LOST,
        FaultClass.OOM_KILLED,
        FaultClass.EVICTED,
        FaultClass.HEARTBEAT_LOST,
    }
)
HUNG_CLASSES = frozenset({FaultClass.HANG, FaultClass.STALLED})

#: Where a restart's state came from (wire.RestoredFrom), as the timeline's hover says it.
RESTORED_FROM_WORDS = {RestoredFrom.MEMORY: "memory", RestoredFrom.LOCAL: "the node-local copy",
                       RestoredFrom.DISK: "disk"}


@dataclass(slots=True)
class Span:
    start: float
    end: float
    phase: str
    lane: int | None  # None: job-wide
    label: str = ""
    open: bool = False  # still running at `now` (the page extends it as time passes)


def ts(dt) -> float | None:
    return dt.timestamp() if dt is not None else None


def phase_for_fault(fault_class: str) -> str:
    if fault_class in DEAD_CLASSES:
        return DEAD
    if fault_class in HUNG_CLASSES:
        return HUNG
    return RESTARTING  # the rank raised (exception, NaN): it is already unwinding into a restart


def job_spans(
    *,
    start: float,
    first_step: float | None,
    end: float,
    is_open: bool,
    cycles: list[dict],
    checkpoints: list[dict],
) -> list[Span]:
    """Job-wide spans. ``cycles`` and ``checkpoints`` are dicts of unix-second floats (or None)."""
    spans: list[Span] = []
    train_from = first_step if first_step is not None else end
    if train_from > start:
        spans.append(
            Span(start, train_from, STARTING, None, "start → first step", open=is_open and first_step is None)
        )
    if first_step is not None and end > first_step:
        spans.append(Span(first_step, end, TRAINING, None, "training", open=is_open))
    for ck in checkpoints:
        blocked = ck["blocking_s"]
        if blocked is None and ck["mode"] == "sync" and ck["finished_at"] is not None:
            blocked = ck["finished_at"] - ck["started_at"]
        if blocked is None:
            continue
        spans.append(
            Span(
                ck["started_at"],
                min(end, ck["started_at"] + max(blocked, 0.0)),
                CHECKPOINT_SAVE,
                None,
                f"save step {ck['step']} ({ck['mode']}, {ck['state']}): loop blocked {blocked:.2f} s",
            )
        )
    for c in cycles:
        detected = c["detected_at"] or c["fault_at"]
        restarted, loaded, first = c["restarted_at"], c["checkpoint_loaded_at"], c["first_step_at"]
        key = c["key"]
        if detected is not None:
            stop = restarted or loaded or first
            spans.append(
                Span(
                    detected,
                    stop or end,
                    RESTARTING,
                    None,
                    f"{key}: detect → abort → restart",
                    open=stop is None and is_open,
                )
            )
        if restarted is not None:
            stop = loaded or first
            spans.append(
                Span(
                    restarted,
                    stop or end,
                    CHECKPOINT_LOAD,
                    None,
                    f"{key}: restoring from {RESTORED_FROM_WORDS.get(c.get('restored_from') or '', 'checkpoint')}",
                    open=stop is None and is_open,
                )
            )
        if loaded is not None:
            spans.append(
                Span(
                    loaded,
                    first or end,
                    RESTARTING,
                    None,
                    f"{key}: first step after reload",
                    open=first is None and is_open,
                )
            )
    return [s for s in spans if s.end > s.start or s.open]


def rank_spans(
    *, end: float, is_open: bool, faults: list[dict], cycles_by_id: dict[int, dict], ranks: list[dict]
) -> list[Span]:
    """Per-rank spans: hung or dead, from faults and from each rank's latest facts."""
    spans: list[Span] = []
    for f in faults:
        if f["rank"] is None:
            continue
        phase = phase_for_fault(f["fault_class"])
        c = cycles_by_id.get(f["cycle_id"]) if f["cycle_id"] else None
        if c is not None:
            stop = c["aborted_at"] or c["restarted_at"] or c["checkpoint_loaded_at"] or c["first_step_at"]
        else:
            # No cycle: the fault lasted until it was detected; whatever followed (a lost or stalled rank)
            # comes from the rank's own facts below.
            if not f["detected_at"] or f["detected_at"] <= f["at"]:
                continue
            stop = f["detected_at"]
        spans.append(
            Span(
                f["at"],
                stop or end,
                phase,
                f["rank"],
                f"{f['fault_class']} on rank {f['rank']}",
                open=stop is None and is_open,
            )
        )
    for r in ranks:
        if r["health"] == "lost" and r["last_heartbeat_at"] is not None:
            spans.append(
                Span(r["last_heartbeat_at"], end, DEAD, r["rank"], "no heartbeat since", open=is_open)
            )
        elif r["health"] == "stalled" and r["step_changed_at"] is not None:
            spans.append(
                Span(
                    r["step_changed_at"],
                    end,
                    HUNG,
                    r["rank"],
                    "heartbeats but no step progress",
                    open=is_open,
                )
            )
    return [s for s in spans if s.end > s.start or s.open]
