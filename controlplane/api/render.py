"""Rows to response types. Every figure is read from the model or ``controlplane.jobs.readouts``, the
same source as the job page; this module only copies them across."""

from __future__ import annotations

from datetime import datetime

from django.db.models import Count
from django.urls import reverse

from controlplane.api import schema
from controlplane.jobs import attribution, readouts
from controlplane.jobs import models as m
from controlplane.jobs.evidence import fault_evidence
from controlplane.jobs.goodput import PARTS
from controlplane.jobs.versions import runtime_versions
from trainer.wire import Layer, redact


def links(job: m.Job) -> schema.JobLinks:
    base = reverse("api:job", args=[job.pk])
    return schema.JobLinks(
        self=base, ranks=f"{base}/ranks", faults=f"{base}/faults", cycles=f"{base}/cycles",
        checkpoints=f"{base}/checkpoints", commands=f"{base}/commands", goodput=f"{base}/goodput",
        samples=f"{base}/samples", audit=f"{base}/audit", quarantined=f"{base}/quarantined",
        log=f"{base}/log",        page=reverse("dashboard:job", args=[job.pk]),
    )


def _job_fields(job: m.Job) -> dict:
    step = readouts.step_shown(job) if job.is_active else job.last_step
    return dict(
        id=job.pk, name=job.name, status=job.status, status_reason=job.status_reason, backend=job.backend,
        attempt=job.attempt, last_step=step, steps=job.job_spec.steps,
        progress_pct=readouts.progress_pct(job, step), created_at=job.created_at, started_at=job.started_at,
        first_step_at=job.first_step_at, finished_at=job.finished_at, spec=job.spec, links=links(job),
    )


def job(job: m.Job) -> schema.Job:
    return schema.Job(**_job_fields(job))


def goodput(job: m.Job, now: datetime) -> schema.Goodput:
    g = job.goodput(now)
    return schema.Goodput(
        goodput=g["goodput"], wall_s=g["wall_s"],
        shares=schema.GoodputParts(**{k: g[k] for k in PARTS}),
        seconds=schema.GoodputParts(**{k: g[f"{k}_s"] for k in PARTS}),
    )


def job_detail(job: m.Job, now: datetime) -> schema.JobDetail:
    ranks: dict[str, int] = {}
    for f in readouts.rank_figures(job, readouts.world(job, m.Rank.objects.filter(job=job)), now):
        ranks[f.health] = ranks.get(f.health, 0) + 1
    commands = dict(
        m.Command.objects.filter(job=job).values_list("status").annotate(n=Count("id")).order_by()
    )
    states = m.Checkpoint.objects.filter(job=job).values_list("state", flat=True)
    summary = schema.Summary(
        goodput=goodput(job, now),
        restarts={layer.value: 0 for layer in Layer if layer != Layer.NONE}
        | readouts.restarts_by_layer([job.pk]).get(job.pk, {}),
        faults=m.Fault.objects.filter(job=job).count(),
        checkpoints=readouts.checkpoint_counts(states),
        ranks=ranks,
        commands=commands,
        quarantined=m.QuarantinedHeartbeat.objects.filter(job=job).count(),
    )
    reported = readouts.integration(job)
    integration = schema.Integration(
        entrypoint=job.job_spec.entrypoint, level=reported.level, versions=reported.versions
    ) if reported is not None else None
    ran_with = [schema.RanWith(**v) for v in runtime_versions(job)]
    return schema.JobDetail(**_job_fields(job), summary=summary, integration=integration, ran_with=ran_with)


def rank(f: readouts.RankFigures, now: datetime) -> schema.Rank:
    return schema.Rank(
        rank=f.rank, node=f.node, health=f.health,
        heartbeat_at=datetime.fromtimestamp(f.hb_at, tz=now.tzinfo) if f.hb_at is not None else None,
        heartbeat_age_s=max(0.0, now.timestamp() - f.hb_at) if f.hb_at is not None else None,
        phase=f.phase, step=f.step, loss=f.loss, step_time_s=f.step_time_s, pid=f.pid,
        busy_s=f.busy_s, slowdown_pct=f.slowdown_pct,
    )


def fault(f: m.Fault, rank_nodes: dict[int, str] | None = None, *, ended: bool = False,
          summary: str | None = None) -> schema.Fault:
    fig = readouts.fault_figures(f, rank_nodes=rank_nodes, ended=ended)
    if summary is None:
        summary = fault_evidence(f, rank_nodes=rank_nodes, ended=ended).summary
    echoes = attribution.consequences(f) if f.primary_id is None else []
    return schema.Fault(
        id=f.pk, at=f.at, detected_at=f.detected_at, fault_class=f.fault_class, rank=f.rank, node=fig.node,
        detected_by=f.detected_by, message=(msg := redact(f.message)), traceback=readouts.traceback_in(msg),
        cycle=f.cycle.key if f.cycle is not None else None, layer=fig.layer, escalated_to=fig.escalated_to,
        detection_s=fig.detection_s, recovery_s=fig.recovery_s, recovering=fig.recovering,
        lost_steps=fig.lost_steps, summary=summary, primary=f.primary_id, link=f.link or None,
        why=f.why or None, count=f.count,
        occurrences=attribution.occurrences(f) if f.count > 1 else [f.at],
        consequences=[schema.FaultEcho(id=e.pk, rank=e.rank, fault_class=e.fault_class, why=e.why)
                      for e in echoes],
    )


def cycle(c: m.RestartCycle) -> schema.Cycle:
    return schema.Cycle(
        id=c.pk, key=c.key, layer=c.layer, reason=c.reason, escalated_to=c.escalated_to or None,
        superseded=bool(c.escalated_to),
        marks=schema.CycleMarks(
            fault_at=c.fault_at, delivered_at=c.delivered_at, detected_at=c.detected_at,
            aborted_at=c.aborted_at,
            restarted_at=c.restarted_at,
            checkpoint_loaded_at=c.checkpoint_loaded_at, first_step_at=c.first_step_at,
        ),
        durations=schema.CycleDurations(**{"deliver": None, **c.durations()}),
        detection_s=c.detection_s, recovery_s=c.recovery_s, step_at_fault=c.step_at_fault,
        resumed_from_step=c.resumed_from_step, lost_steps=c.lost_steps,
    )


def checkpoint(c: m.Checkpoint) -> schema.Checkpoint:
    fig = readouts.checkpoint_figures(
        started_at=c.started_at.timestamp(), finished_at=c.finished_at.timestamp() if c.finished_at else None,
        state=c.state, write_s=c.write_s, nbytes=c.bytes,
    )
    return schema.Checkpoint(
        id=c.pk, step=c.step, attempt_key=c.attempt_key, mode=c.mode, state=c.state, started_at=c.started_at,
        finished_at=c.finished_at, blocking_s=c.blocking_s, write_s=c.write_s, bytes=c.bytes,
        interference_s=c.interference_s,
        elapsed_s=fig.elapsed_s, durable_s=fig.durable_s, mb_per_s=fig.mb_per_s,
    )


def command(c: m.Command) -> schema.Command:
    return schema.Command(
        id=c.pk, kind=c.kind, level=c.level or None, fault=c.fault or None, rank=c.rank, status=c.status,
        detail=c.detail, issued_by=c.issued_by.get_username() if c.issued_by else None, issued_at=c.issued_at,
        delivered_at=c.delivered_at, acked_at=c.acked_at,
    )


def sample(t: m.TrainingSample) -> schema.Sample:
    return schema.Sample(id=t.pk, at=t.at, rank=t.rank, step=t.step, loss=t.loss, step_time_s=t.step_time_s,
                         tokens_per_s=t.tokens_per_s)


def audit(a: m.AuditEntry) -> schema.AuditEntry:
    return schema.AuditEntry(id=a.pk, at=a.at, actor=a.actor_name, action=a.action, detail=a.detail,
                             remote_addr=a.remote_addr)


def quarantined(q: m.QuarantinedHeartbeat) -> schema.Quarantined:
    return schema.Quarantined(id=q.pk, rank=q.rank, reason=q.reason, payload=q.payload, at=q.at,
                              count=q.count)


def evidence(ev) -> schema.Evidence:
    return schema.Evidence(
        summary=ev.summary, exception_type=ev.exception_type, exception_message=ev.exception_message,
        frames=[schema.Frame(file=f.file, line=f.line, function=f.function, code=f.code) for f in ev.frames],
        signal=ev.signal, exit_code=ev.exit_code, phase=ev.phase, step=ev.step, log=ev.log, log_why=ev.log_why,
        reason=ev.reason, termination_message=ev.termination_message,
    )
