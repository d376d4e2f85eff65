"""Every benchmark script starts: its module-level imports resolve and it answers ``--help`` (a benchmark
that cannot start would otherwise be found broken only when someone runs it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parents[1]
SCRIPTS = sorted(p.name for p in BENCH.glob("bench_*.py"))


def test_it_finds_the_benchmarks():
    assert {"bench_report.py", "bench_attribution.py", "bench_recovery.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_benchmark_starts(script):
    out = subprocess.run([sys.executable, str(BENCH / script), "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "usage:" in out.stdout, out.stderr[-3000:]


def test_the_ingest_benchmarks_job_is_a_spec_an_operator_could_start():
    """Its spec is validated as any job's is: a rule added to the spec fails this, not the next run."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_ingest", BENCH / "bench_ingest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    job = module.job_spec(module.parser().parse_args([]))
    assert job.procs_per_node == 100_000 and job.step_timeout_s == 12.0
