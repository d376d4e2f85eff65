"""The benchmarks' shared statistics and verdict (tests/bench/stats.py)."""

import pytest

from tests.bench.stats import Target, figure, median, percentile, verdict


def test_it_takes_percentiles_by_nearest_rank():
    xs = list(range(1, 17))  # 16 values
    assert percentile(xs, 0.95) == 16  # ceil(15.2) = 16th: the largest, not the second-worst
    assert percentile(xs, 0.5) == 8
    assert median([3.0, 1.0, 2.0, 10.0]) == 2.0  # a measured value, not 2.5
    assert percentile([5.0], 0.99) == 5.0
    assert percentile(range(1, 101), 0.99) == 99


def test_it_gives_nan_for_no_values_and_rejects_a_bad_quantile():
    assert percentile([], 0.5) != percentile([], 0.5)
    with pytest.raises(ValueError, match="q must be in"):
        percentile([1.0], 95)
    assert figure([]) == "none (n=0)"
    assert figure([2.0, 1.0, 3.0], nd=1) == "median 2.0 (1.0..3.0, n=3)"


def test_it_fails_the_run_when_a_target_is_missed_or_its_figure_is_absent(capsys):
    assert verdict({"p99_ms": 12.0, "lost": 0}, [Target("p99_ms", "<=", 50), Target("lost", "==", 0)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "targets: met"
    assert verdict({"p99_ms": 51.0}, [Target("p99_ms", "<=", 50)]) == 1
    assert verdict({"p99_ms": float("nan")}, [Target("p99_ms", "<=", 50)]) == 1
    assert verdict({}, [Target("rate", ">=", 1)]) == 1
    out = capsys.readouterr().out
    assert "target p99_ms <= 50: 51 MISSED" in out and "target rate >= 1: absent MISSED" in out
    assert out.splitlines()[-1] == "targets: MISSED rate"
    with pytest.raises(ValueError, match="op must be one of"):
        Target("x", "<", 1)
