"""What the benchmarks count from their records: every restart, every cycle (tests/bench/)."""

import math

from tests.bench import bench_recovery
from tests.bench.bench_chaos import ranks_steps_lost


def test_it_counts_the_steps_each_rank_ran_twice(tmp_path):
    # rank 0: fault after step 7, resumed at checkpoint 5 (6, 7 again); a second restart with none lost
    steps = [1, 2, 3, 4, 5, 6, 7, 6, 7, 8, 9, 10, 9, 10]
    (tmp_path / "rank0.log").write_text("".join(f"{s} 1 0.0\n" for s in steps))
    # rank 1 reached step 8 before the first restart: the larger count is the steps lost
    steps = [1, 2, 3, 4, 5, 6, 7, 8, 6, 7, 8, 9, 10, 9]
    (tmp_path / "rank1.log").write_text("".join(f"{s} 2 0.0\n" for s in steps))
    assert ranks_steps_lost(tmp_path) == [3, 2]


def test_it_counts_no_restart_in_a_run_without_one(tmp_path):
    (tmp_path / "rank0.log").write_text("1 1 0.0\n2 1 0.0\n3 1 0.0\n")
    assert ranks_steps_lost(tmp_path) == []


def test_it_counts_an_unmarked_cycle_and_a_missing_one_as_infinite(monkeypatch):
    monkeypatch.setattr(bench_recovery, "UNMARKED", [])

    def mark(cycle, mark, at):
        return {"kind": "cycle", "at": at, "data": {"cycle": cycle, "mark": mark}}

    events = [mark("c1", "fault_at", 10.0), mark("c1", "first_step_at", 10.4),
              mark("c1", "first_step_at", 10.5), mark("c2", "fault_at", 20.0)]  # c2 never stepped again
    out = bench_recovery.recoveries(events, 3, "test")
    assert out[0] == 0.5 and out[1:] == [math.inf, math.inf]  # c2 unmarked; the third drill made no cycle
    assert len(bench_recovery.UNMARKED) == 2
