"""Judge a run's heartbeats the way the control plane does as they arrive (for tests and the benchmark)."""

from __future__ import annotations


def straggler_marks(batches: list[dict], margin_pct: float) -> list[tuple[float, int]]:
    """(received_at, rank) each time a rank becomes a straggler, by ``jobs/rank_health.py``'s ``slowdowns`` over
    every rank's newest ``busy_s`` after each batch, in arrival order."""
    from controlplane.jobs import rank_health

    newest: dict[int, tuple[float, float]] = {}  # rank -> (at, busy_s)
    marked: set[int] = set()
    out = []
    for b in sorted(batches, key=lambda b: b["_received_at"]):
        for h in b.get("heartbeats", []):
            if h.get("phase") != "train" or h.get("busy_s") is None:
                continue
            if h["rank"] not in newest or h["at"] > newest[h["rank"]][0]:
                newest[h["rank"]] = (h["at"], h["busy_s"])
        slow = rank_health.slowdowns({r: v for r, (_, v) in newest.items()}, margin_pct)
        out += [(b["_received_at"], r) for r in sorted(set(slow) - marked)]
        marked = set(slow)
    return out
