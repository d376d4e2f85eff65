"""Attribution benchmark: the attribution matrix (``tests/e2e/test_attribution_matrix.py``) on the local
backend, each cell run several times with real processes.

    python tests/bench/bench_attribution.py [--runs 3] [--cells level0-sigkill-r1,level2-hang-r1]

Per run: whether the primary fault names the injected rank and class (``primary_correct``, the share of
runs), the primary faults beyond one per injected failure (``extra_faults``, summed), and the seconds from
the injected failure to the moment the API shows its final attribution, i.e. which fault is the primary
(``attribution_s``; ``settled_s``, printed before the last line, runs to the last change of any fault's
link, such as the watchdog's heartbeat loss during the restart linked as a consequence; for a hang,
from the moment the job's step timeout makes it a failure; a run with no figure counts as infinitely
slow). Percentiles are nearest-rank. Last line exactly:

    cells=<N> runs=<R> primary_correct=<P> extra_faults=<E> attribution_p95_s=<S>

Exits 1 when a target is missed: primary_correct=1.0, extra_faults=0, attribution_p95_s <= 3.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MODULE = "tests/e2e/test_attribution_matrix.py"
TEST = "test_the_primary_fault_names_the_injected_rank_and_class"
TARGET_P95_S = 3.0


def all_cells() -> list[str]:
    from tests.e2e.matrix.cells import CELL_IDS

    return list(CELL_IDS)


def nearest_rank(xs: list[float], q: float) -> float:
    """The nearest-rank percentile ``q`` (0-100) of ``xs``."""
    if not xs:
        return math.inf
    ordered = sorted(xs)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summarise(rows: list[dict]) -> dict:
    cells = {r["cell"] for r in rows}
    times = [r["attribution_s"] if r.get("attribution_s") is not None else math.inf for r in rows]
    settled = [r["settled_s"] if r.get("settled_s") is not None else math.inf for r in rows]
    return {"cells": len(cells), "runs": len(rows), "settled_p95_s": nearest_rank(settled, 95),
            "primary_correct": round(sum(1 for r in rows if r["primary_correct"]) / len(rows), 3)
            if rows else 0.0,
            "extra_faults": sum(int(r["extra_faults"]) for r in rows),
            "attribution_p95_s": nearest_rank(times, 95)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3, help="runs of each cell (at least 3 for the figure)")
    p.add_argument("--cells", default="",
                   help="comma-separated cell ids (level<L>-<failure>-r<rank>); all by default")
    args = p.parse_args()
    known = all_cells()
    cells = [c.strip() for c in args.cells.split(",") if c.strip()] or known
    unknown = [c for c in cells if c not in known]
    if unknown:
        p.error(f"unknown cells {unknown}; known: {', '.join(known)}")
    if args.runs < 1:
        p.error("--runs must be at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp) / "results.jsonl"
        env = {**os.environ, "MATRIX_RESULTS": str(results), "MATRIX_FULL": "1", "PYTHONPATH": str(ROOT)}
        ids = [f"{MODULE}::{TEST}[{c}]" for c in cells]
        for i in range(args.runs):
            print(f"run {i + 1} of {args.runs}: {len(ids)} cells", flush=True)
            subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "slow", "-p", "no:cacheprovider",
                            *ids], cwd=ROOT, env=env, check=False)
        rows = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    for r in rows:
        print(f"{r['cell']}: primary_correct={r['primary_correct']} primaries={r['primaries']} "
              f"attribution_s={r['attribution_s']} settled_s={r.get('settled_s')}")
    s = summarise(rows)
    p95 = "inf" if math.isinf(s["attribution_p95_s"]) else f"{s['attribution_p95_s']:.2f}"
    missing = len(cells) * args.runs - len(rows)
    if missing:
        print(f"{missing} run(s) left no result (the test errored before the job ran)")
    print(f"settled_p95_s={s['settled_p95_s']:.2f}")
    print(f"cells={s['cells']} runs={s['runs']} primary_correct={s['primary_correct']} "
          f"extra_faults={s['extra_faults']} attribution_p95_s={p95}")
    ok = (not missing and s["primary_correct"] == 1.0 and s["extra_faults"] == 0
          and s["attribution_p95_s"] <= TARGET_P95_S)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
