"""The fault table: primary faults (their echoes and repeats folded under them), filtered and paged, with
the operator's restarts between them, the failure policy's rules and what it will do next."""

from __future__ import annotations

from django.core.paginator import Paginator

from controlplane.dashboard import fleet
from controlplane.dashboard.words import LAYER_NAMES, command_summary, fmt_s, layer_words, recovery_words
from controlplane.jobs import policy, readouts
from controlplane.jobs.models import Fault, Job, RestartCycle
from trainer.wire import Layer, redact

FAULTS_PER_PAGE = 25
FAULT_FILTERS = ("fault_class", "layer", "rank")


def faults_part(job: Job, params) -> dict:
    # Primary faults; each one's consequences and repeats fold under it (``jobs.attribution``).
    qs = Fault.objects.filter(job=job, primary__isnull=True).select_related("cycle").order_by("-at", "-id")
    chosen = {k: params.get(k, "") for k in FAULT_FILTERS}
    if chosen["fault_class"]:
        qs = qs.filter(fault_class=chosen["fault_class"])
    if chosen["layer"]:
        qs = qs.filter(cycle__layer=chosen["layer"])
    if chosen["rank"] not in ("", None):
        try:
            qs = qs.filter(rank=int(chosen["rank"]))
        except ValueError:
            chosen["rank"] = ""
    page = Paginator(qs, FAULTS_PER_PAGE).get_page(params.get("page"))
    nodes = fleet.rank_nodes(job, {f.rank for f in page.object_list if f.rank is not None})
    rows = []
    echoes: dict[int, list[Fault]] = {}
    repeats: dict[int, list[Fault]] = {}
    for e in Fault.objects.filter(primary__in=[f.pk for f in page.object_list]).order_by("at", "id"):
        (repeats if e.link == "repeat" else echoes).setdefault(e.primary_id, []).append(e)
    for f in page.object_list:
        fig = readouts.fault_figures(f, rank_nodes=nodes, ended=not job.is_active)
        rows.append(
            {
                "f": f,
                "at": f.at if job.finished_at is None else min(f.at, job.finished_at),
                "message": redact(f.message),
                "node": fig.node,
                "layer": layer_words(fig.layer, fig.escalated_to),
                "detection": fmt_s(fig.detection_s),
                "recovery": recovery_words(fig),
                "lost": fig.lost_steps,
                "echoes": [e.why for e in echoes.get(f.pk, [])],
                "times": [x.at for x in repeats.get(f.pk, [])],
            }
        )
    if not chosen["fault_class"] and chosen["rank"] in ("", None):
        rows = sorted(rows + _restart_rows(job, page, chosen["layer"]), key=lambda r: r["at"], reverse=True)
    classes = sorted(set(Fault.objects.filter(job=job).values_list("fault_class", flat=True).distinct()))
    spec = job.job_spec
    return {
        "next": policy.what_next(job),
        "rules": [f"{i + 1}. {r.words()}" for i, r in enumerate(spec.failure_policy)],
        "page": page,
        "rows": rows,
        "chosen": chosen,
        "classes": classes,
        "layers": [(v.value, LAYER_NAMES[v.value]) for v in Layer],
        # A large job's rank filter is a number field, not 100,000 options.
        "ranks": None if fleet.is_large(job) else range(job.world_size),
    }


def _restart_rows(job: Job, page, layer: str) -> list[dict]:
    """The operator's restarts on this page of the fault table (between its oldest and newest fault): an
    action, not a fault, with the cycle's figures and its phases (deliver, detect, ...) in the hover."""
    cycles = (RestartCycle.objects.filter(job=job, command__kind="restart")
              .select_related("command__issued_by"))
    if layer:
        cycles = cycles.filter(layer=layer)
    faults = list(page.object_list)
    if faults and page.has_previous():
        cycles = cycles.filter(fault_at__lte=faults[0].at)
    if faults and page.has_next():
        cycles = cycles.filter(fault_at__gt=faults[-1].at)
    rows = []
    for c in cycles.order_by("-fault_at")[:FAULTS_PER_PAGE]:
        if c.start_at is None:
            continue
        who = c.command.issued_by.get_username() if c.command.issued_by else "system"
        recovering = c.recovery_s is None and job.is_active
        rows.append({
            "action": True,
            "at": c.start_at if job.finished_at is None else min(c.start_at, job.finished_at),
            "summary": f"{command_summary(c.command)} asked for by {who}",
            "layer": layer_words(c.layer, c.escalated_to),
            "detection": "–",
            "recovery": fmt_s(c.recovery_s) if c.recovery_s is not None else (
                "in progress" if recovering else "–"),
            "breakdown": " · ".join(f"{k.replace('_', ' ')} {fmt_s(v)}"
                                    for k, v in c.durations().items()),
            "lost": c.lost_steps,
        })
    return rows
