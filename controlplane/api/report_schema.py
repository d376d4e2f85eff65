"""The report's query parameters (its response type is ``jobs.resilience_report.Report``)."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct

from controlplane.jobs import projection


class ReportQuery(Struct, forbid_unknown_fields=True, kw_only=True):
    """The scale to project goodput at: a job size and a failure rate (``interruptions`` in ``days`` on
    ``on_gpus`` GPUs). The default is the Llama 3 report's: 419 in 54 days on 16,384 GPUs."""

    gpus: Annotated[int, Meta(ge=1, le=10_000_000, description="GPUs of the job at scale")] = (
        projection.LLAMA3.gpus)
    interruptions: Annotated[float, Meta(ge=0, le=1e9, description="failures seen ...")] = (
        projection.LLAMA3.interruptions)
    days: Annotated[float, Meta(gt=0, le=1e6, description="... in this many days ...")] = (
        projection.LLAMA3.days)
    on_gpus: Annotated[int, Meta(ge=1, le=100_000_000, description="... on this many GPUs")] = (
        projection.LLAMA3.gpus)
    format: Annotated[Literal["json", "html"], Meta(
        description="html: the report as one self-contained HTML file (plotly inlined, no network), as an "
                    "attachment")] = "json"

    def rate(self) -> projection.FailureRate:
        r = projection.LLAMA3
        if (self.interruptions, self.days, self.on_gpus) == (r.interruptions, r.days, r.gpus):
            return r
        return projection.FailureRate(interruptions=self.interruptions, days=self.days, gpus=self.on_gpus,
                                      source="given with the request")


class CheckCreate(Struct, forbid_unknown_fields=True, kw_only=True):
    """A resilience check of the job: its spec run again with this drill plan (omitted fields: the default
    plan, every class the job's integration level supports on the first and the last rank). ``dry_run``
    answers the plan and its time budget without starting anything."""

    faults: list[str] | None = None
    placements: list[str] | None = None
    ranks: list[str] | None = None
    repeats: Annotated[int, Meta(ge=1, le=10)] = 1
    dry_run: bool = False


class CheckDrill(Struct, kw_only=True):
    step: int
    fault: str
    rank: int


class Check(Struct, kw_only=True):
    """The plan, the drills it lays out, the time budget, and the run it started (null on a dry run)."""

    faults: list[str]
    placements: list[str]
    ranks: list[str]
    repeats: int
    drills: list[CheckDrill]
    steps: int
    budget_s: float
    run: int | None
    run_url: str | None
