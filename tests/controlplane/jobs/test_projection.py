"""The goodput projection (``jobs/projection.py``) is a pure function: its properties over generated
figures."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.jobs import projection as p

interval = st.floats(min_value=0.5, max_value=1e5)
cost = st.floats(min_value=0.0, max_value=1e3)
rate = st.floats(min_value=1e-9, max_value=1e-3)
recovery = st.floats(min_value=0.0, max_value=600.0)
# A loaded machine must not fail a property for generating slowly.
relaxed = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@relaxed
@given(interval, cost, recovery)
def test_it_charges_only_the_checkpoints_when_nothing_fails(i, c, r):
    g = p.goodput(interval_s=i, save_cost_s=c, rate_per_s=0.0, recovery_s=r)
    assert g == pytest.approx(1 - c / (i + c), rel=1e-12, abs=1e-12)


@relaxed
@given(interval, cost, rate, rate, recovery)
def test_it_falls_as_the_failure_rate_rises(i, c, a, b, r):
    lo, hi = sorted((a, b))
    g_lo = p.goodput(interval_s=i, save_cost_s=c, rate_per_s=lo, recovery_s=r)
    g_hi = p.goodput(interval_s=i, save_cost_s=c, rate_per_s=hi, recovery_s=r)
    assert g_hi <= g_lo
    # Strictly lower where the rates' difference moves the model past float resolution near 1.
    if (hi - lo) * (r + (i + c) / 2) > 1e-12 and g_hi > 0:
        assert g_hi < g_lo


@relaxed
@given(cost.filter(lambda c: c > 1e-3), rate, recovery, st.floats(min_value=0.05, max_value=20.0))
def test_it_finds_the_interval_that_maximises_the_model(c, lam, r, factor):
    best = p.optimum_interval_s(save_cost_s=c, rate_per_s=lam, recovery_s=r)
    if best is None:
        assert lam * r >= 1
        return
    g_best = p.goodput(interval_s=best, save_cost_s=c, rate_per_s=lam, recovery_s=r)
    other = best * factor
    g_other = p.goodput(interval_s=other, save_cost_s=c, rate_per_s=lam, recovery_s=r)
    assert g_best >= g_other - 1e-12


@relaxed
@given(cost.filter(lambda c: c > 1e-3), rate)
def test_it_agrees_with_young_when_recovery_is_free(c, lam):
    best = p.optimum_interval_s(save_cost_s=c, rate_per_s=lam, recovery_s=0.0)
    young = math.sqrt(2 * c / lam)  # Young (1974): the period sqrt(2 * cost * MTBF)
    assert best + c == pytest.approx(young, rel=1e-9)


def test_it_defaults_to_the_llama3_rate():
    # 419 interruptions / (54 days * 24 h) on the whole cluster: one every ~3.1 hours.
    lam = p.LLAMA3.at(16384)
    assert 1 / lam / p.HOUR_S == pytest.approx(54 * 24 / 419)
    assert "Llama 3" in p.LLAMA3.source


def test_it_projects_layers_above_job_restarts():
    proj = p.project(gpus=16384, rate=p.LLAMA3, step_time_s=2.0, interval_steps=100, save_cost_s=3.0,
                     recoveries={"with its layers": 15.0, "job-level restarts only": 270.0})
    layers, job_only = proj.scenarios
    assert layers.goodput_now > job_only.goodput_now
    assert layers.goodput_best >= layers.goodput_now - 1e-9
    assert layers.best_interval_steps is not None and layers.best_interval_steps >= 1
    assert not proj.caveats


def test_it_warns_where_the_model_stops_holding():
    proj = p.project(gpus=10**7, rate=p.LLAMA3, step_time_s=1.0, interval_steps=1000, save_cost_s=1.0,
                     recoveries={"x": 100.0})
    assert proj.caveats


def test_it_refuses_a_meaningless_rate():
    with pytest.raises(ValueError, match="419 interruptions"):
        p.FailureRate(interruptions=1, days=0, gpus=8)


@relaxed
@given(st.floats(min_value=1, max_value=1e5), st.floats(min_value=0, max_value=100), interval, cost, rate,
       recovery)
def test_it_charges_a_finite_run_its_startup(work, startup, i, c, lam, r):
    g = p.goodput(interval_s=i, save_cost_s=c, rate_per_s=lam, recovery_s=r)
    run = p.run_goodput(work_s=work, startup_s=startup, interval_s=i, save_cost_s=c, rate_per_s=lam,
                        recovery_s=r)
    assert run <= g + 1e-12
    if startup == 0:
        assert run == pytest.approx(g)
