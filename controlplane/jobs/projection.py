"""Goodput at scale: what a job's own measured figures predict for a long run at a given size and failure
rate. Pure functions, no Django: the report feeds them the job's figures; the property tests feed them
generated ones.

The model is the first-order one behind Young's and Daly's checkpoint intervals. Training alternates
``interval_s`` of work with a save that costs the loop ``save_cost_s`` (blocked time, plus an async
save's slower steps). Failures arrive at ``rate_per_s`` over wall time; each costs its recovery time
(fault to first step, by the layer that catches it) plus the work since the last save, half a period on
average: every layer in this product resumes from the newest checkpoint. So over one period
``T = interval_s + save_cost_s``::

    goodput = interval_s / T * (1 - rate * (recovery_s + T / 2))      (clipped to 0..1)

which is ``1 - save_cost_s / T`` with no failures, falls linearly as the rate rises, and is largest at
``T* = sqrt(2 * save_cost_s * (1 - rate * recovery_s) / rate)`` (``optimum_interval_s``; Young's
``sqrt(2 * save_cost_s * MTBF)`` when recovery is short against the MTBF). A first-order model: it
assumes at most about one failure per period (``rate * T`` well below 1) and recoveries much shorter
than the MTBF; the report says when a projection leaves that range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

HOUR_S = 3600.0
DAY_S = 24 * HOUR_S


@dataclass(frozen=True, slots=True)
class FailureRate:
    """A published or user-given failure rate: ``interruptions`` in ``days`` on ``gpus`` GPUs."""

    interruptions: float
    days: float
    gpus: int
    source: str = ""
    url: str = ""

    def __post_init__(self) -> None:
        if not (self.interruptions >= 0 and self.days > 0 and self.gpus >= 1):
            raise ValueError("a failure rate needs interruptions >= 0, days > 0 and gpus >= 1 "
                             "(e.g. 419 interruptions in 54 days on 16384 GPUs)")

    @property
    def per_gpu_hour(self) -> float:
        return self.interruptions / (self.days * 24 * self.gpus)

    def at(self, gpus: int) -> float:
        """Failures per second of a job on ``gpus`` GPUs (rates add up: each GPU fails independently)."""
        return self.per_gpu_hour * gpus / HOUR_S


# Meta's Llama 3 report, section 3.3.4: 419 unexpected interruptions in a 54-day snapshot of pre-training
# on up to 16,384 H100 GPUs.
LLAMA3 = FailureRate(interruptions=419, days=54, gpus=16384,
                     source="The Llama 3 Herd of Models (Meta, 2024), section 3.3.4: 419 unexpected "
                            "interruptions in 54 days of pre-training on 16,384 H100 GPUs",
                     url="https://arxiv.org/abs/2407.21783")


@dataclass(frozen=True, slots=True)
class PublishedRow:
    layer: str
    recovery_s: float  # per fault, as published
    goodput_pct: float


# The AWS/NVRx recipe's own table, from its cluster (not ours): 5 faults in a 2,000-step test.
AWS_RECIPE = (
    PublishedRow("in-process restart (NVRx inprocess)", 10.0, 31.0),
    PublishedRow("in-job restart (ft_launcher)", 17.0, 25.5),
    PublishedRow("plain Kubernetes job restart", 270.0, 11.5),
)
AWS_RECIPE_SOURCE = ("AWS's NVIDIA Resiliency Extension recipe for EKS (awsome-distributed-training): "
                     "their own measurement, 5 injected faults in a 2,000-step test; recovery per fault "
                     "~10 s / 17 s / 270 s, training goodput 31 / 25.5 / 11.5 %")


def goodput(*, interval_s: float, save_cost_s: float, rate_per_s: float, recovery_s: float) -> float:
    """Expected goodput (0..1) of training that saves every ``interval_s`` of work (see the module)."""
    if interval_s <= 0 or save_cost_s < 0 or rate_per_s < 0 or recovery_s < 0:
        raise ValueError("interval_s must be > 0; save_cost_s, rate_per_s and recovery_s >= 0")
    period = interval_s + save_cost_s
    return max(0.0, min(1.0, interval_s / period * (1.0 - rate_per_s * (recovery_s + period / 2))))


def optimum_interval_s(*, save_cost_s: float, rate_per_s: float, recovery_s: float,
                       min_interval_s: float = 0.0) -> float | None:
    """The work between saves that maximises ``goodput`` (at least ``min_interval_s``, one step); None
    when there are no failures (never saving is best) or when failures come faster than recovery ends."""
    if rate_per_s <= 0:
        return None
    a = 1.0 - rate_per_s * recovery_s
    if a <= 0:
        return None
    if save_cost_s <= 0:
        return max(min_interval_s, 0.0) or None
    best = math.sqrt(2.0 * save_cost_s * a / rate_per_s) - save_cost_s
    # goodput is concave in the period: the bound is the best point when the optimum lies below it.
    return max(best, min_interval_s)


@dataclass(frozen=True, slots=True)
class Scenario:
    """One way of running the job at scale: how long a fault costs (mean over the faults it meets)."""

    name: str
    recovery_s: float
    goodput_now: float  # at the job's own interval
    best_interval_s: float | None
    best_interval_steps: int | None
    goodput_best: float  # at that interval (= goodput_now when there is no better one)


@dataclass(frozen=True, slots=True)
class Projection:
    gpus: int
    rate: FailureRate
    rate_per_s: float
    mtbf_s: float | None
    step_time_s: float
    interval_steps: int
    interval_s: float
    save_cost_s: float
    scenarios: tuple[Scenario, ...]
    # Where the first-order model stops being a fair guide (e.g. several failures per period).
    caveats: tuple[str, ...] = field(default=())


def project(*, gpus: int, rate: FailureRate, step_time_s: float, interval_steps: int, save_cost_s: float,
            recoveries: dict[str, float]) -> Projection:
    """Goodput of this job at ``gpus`` GPUs under ``rate``, for each named mean recovery time
    (``{"with its layers": 12.0, "job-level restarts only": 95.0}``), at the job's own checkpoint
    interval and at the best one."""
    if gpus < 1:
        raise ValueError("gpus must be at least 1")
    if step_time_s <= 0:
        raise ValueError("step_time_s must be > 0 (the job's median step time)")
    if interval_steps < 1:
        raise ValueError("interval_steps must be at least 1")
    lam = rate.at(gpus)
    interval = interval_steps * step_time_s
    out = []
    for name, r in recoveries.items():
        now = goodput(interval_s=interval, save_cost_s=save_cost_s, rate_per_s=lam, recovery_s=r)
        best = optimum_interval_s(save_cost_s=save_cost_s, rate_per_s=lam, recovery_s=r,
                                  min_interval_s=step_time_s)
        if best is None:
            out.append(Scenario(name, r, now, None, None, now))
            continue
        steps = max(1, round(best / step_time_s))
        out.append(Scenario(name, r, now, best, steps, goodput(interval_s=steps * step_time_s,
                                                                save_cost_s=save_cost_s, rate_per_s=lam,
                                                                recovery_s=r)))
    caveats = []
    period = interval + save_cost_s
    if lam * period > 0.2:
        caveats.append(f"a failure every {1 / lam:.0f} s against a {period:.0f} s checkpoint period: the "
                       "first-order model assumes far fewer than one failure per period")
    if any(lam * r > 0.2 for r in recoveries.values()):
        caveats.append("recovery takes a large share of the time between failures: expect less than shown")
    return Projection(gpus=gpus, rate=rate, rate_per_s=lam, mtbf_s=(1 / lam) if lam > 0 else None,
                      step_time_s=step_time_s, interval_steps=interval_steps, interval_s=interval,
                      save_cost_s=save_cost_s, scenarios=tuple(out), caveats=tuple(caveats))


def run_goodput(*, work_s: float, startup_s: float, interval_s: float, save_cost_s: float,
                rate_per_s: float, recovery_s: float) -> float:
    """Goodput of one finite run: ``work_s`` of steps after ``startup_s`` of start-up, under the model
    (the wall time is start-up plus the work divided by the model's goodput)."""
    g = goodput(interval_s=interval_s, save_cost_s=save_cost_s, rate_per_s=rate_per_s, recovery_s=recovery_s)
    if g <= 0:
        return 0.0
    return work_s / (startup_s + work_s / g)
