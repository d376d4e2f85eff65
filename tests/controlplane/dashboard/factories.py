"""Plain factory functions for dashboard tests: rows created directly, times relative to ``now``."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.contrib.auth.models import Group, User
from django.utils import timezone

from controlplane.jobs.models import Checkpoint, Command, Fault, Job, Rank, RestartCycle
from controlplane.jobs.roles import OPERATORS_GROUP
from controlplane.jobs.spec import JobSpec, KubernetesSpec

PASSWORD = "correct-horse-battery-staple"


def make_user(username: str = "viewer", *, operator: bool = False) -> User:
    user = User.objects.create_user(username=username, password=PASSWORD)
    if operator:
        group, _ = Group.objects.get_or_create(name=OPERATORS_GROUP)
        user.groups.add(group)
    return user


def operator_client():
    """A test client signed in as a new operator."""
    from django.test import Client

    make_user("op", operator=True)
    c = Client()
    assert c.login(username="op", password=PASSWORD)
    return c


def make_job(
    *, now: datetime | None = None, age_s: float = 600.0, status: str = "running", **overrides
) -> Job:
    now = now or timezone.now()
    spec = overrides.pop("spec", None) or JobSpec(procs_per_node=2, steps=400).to_dict()
    started = now - timedelta(seconds=age_s)
    fields = {
        "name": "test",
        "spec": spec,
        "backend": spec.get("backend", "local"),
        "status": status,
        "created_at": started,
        "started_at": started,
        "first_step_at": started + timedelta(seconds=10),
        "last_step": 100,
        "last_progress_at": now,
    }
    fields.update(overrides)
    job = Job(**fields)
    job.issue_token()
    job.save()
    return job


def make_rank(
    job: Job, rank: int, *, now: datetime, node: str = "node-a", hb_age_s: float = 0.5, **kw
) -> Rank:
    hb = now - timedelta(seconds=hb_age_s)
    fields = {
        "node": node,
        "phase": "train",
        "last_heartbeat_at": hb,
        "last_step": job.last_step,
        "step_changed_at": hb,
        "loss": 2.5,
        "step_time_s": 0.5,
        "tokens_per_s": 1000.0,
        "stale_at": hb + timedelta(seconds=30),
        "stall_at": hb + timedelta(seconds=120),
    }
    fields.update(kw)
    return Rank.objects.create(job=job, rank=rank, **fields)


def make_fleet_job(now, *, nodes: int, per_node: int = 8, **kw):
    """A running job of ``nodes`` x ``per_node`` ranks, all beating (rows written in bulk)."""
    spec = JobSpec(backend="kubernetes", nodes=nodes, procs_per_node=per_node, steps=10**6,
                   kubernetes=KubernetesSpec())
    job = make_job(now=now, spec=spec.to_dict(), **kw)
    hb = now - timedelta(seconds=0.5)
    Rank.objects.bulk_create([
        Rank(job=job, rank=r, node=node_name(r // per_node), phase="train", last_heartbeat_at=hb,
             last_step=job.last_step, step_changed_at=hb, step_time_s=0.5, busy_s=0.4,
             stale_at=hb + timedelta(seconds=30), stall_at=hb + timedelta(seconds=120))
        for r in range(nodes * per_node)
    ], batch_size=2000)
    return job


def node_name(i: int) -> str:
    return f"node-{i:04d}"


def silence(job: Job, ranks: list[int], now: datetime, age_s: float = 60.0) -> None:
    """The ranks' last heartbeat ``age_s`` ago, past their 30 s deadline."""
    hb = now - timedelta(seconds=age_s)
    Rank.objects.filter(job=job, rank__in=ranks).update(last_heartbeat_at=hb, stale_at=hb + timedelta(seconds=30))


def make_cycle(
    job: Job,
    key: str,
    *,
    fault_at: datetime,
    layer: str = "in_process",
    marks=(0.2, 0.3, 0.5, 1.0, 1.5),
    step_at_fault: int | None = 55,
    resumed_from_step: int | None = 40,
    **kw,
) -> RestartCycle:
    """``marks``: seconds after the fault of detected, aborted, restarted, checkpoint_loaded, first_step
    (None leaves that mark and all later ones open)."""
    names = ["detected_at", "aborted_at", "restarted_at", "checkpoint_loaded_at", "first_step_at"]
    fields = {}
    for name, off in zip(names, marks, strict=False):
        if off is None:
            break
        fields[name] = fault_at + timedelta(seconds=off)
    if "first_step_at" not in fields:
        resumed_from_step = None
    fields.update(kw)
    return RestartCycle.objects.create(
        job=job,
        key=key,
        layer=layer,
        fault_at=fault_at,
        step_at_fault=step_at_fault,
        resumed_from_step=resumed_from_step,
        reason="test",
        **fields,
    )


def make_fault(
    job: Job,
    *,
    at: datetime,
    rank: int | None = 0,
    fault_class: str = "exception",
    cycle: RestartCycle | None = None,
    detection_s: float = 0.2,
    key: str | None = None,
    **kw,
) -> Fault:
    return Fault.objects.create(
        job=job,
        cycle=cycle,
        fault_class=fault_class,
        rank=rank,
        node=kw.pop("node", "node-a"),
        detected_by=kw.pop("detected_by", "in_process"),
        message=kw.pop("message", "boom"),
        at=at,
        detected_at=at + timedelta(seconds=detection_s),
        source_key=key or f"f-{at.timestamp()}-{rank}-{fault_class}",
        **kw,
    )


def make_checkpoint(
    job: Job,
    step: int,
    *,
    started_at: datetime,
    blocking_s: float = 0.1,
    durable_s: float | None = 2.0,
    state: str = "durable",
    mode: str = "async",
    nbytes: int = 50_000_000,
    interference_s: float | None = None,
) -> Checkpoint:
    return Checkpoint.objects.create(
        job=job,
        step=step,
        mode=mode,
        state=state,
        started_at=started_at,
        blocking_s=blocking_s,
        finished_at=started_at + timedelta(seconds=durable_s) if durable_s is not None else None,
        write_s=(durable_s or 1.0) * 0.8,
        bytes=nbytes,
        interference_s=interference_s,
    )


def make_command(job: Job, *, kind: str = "restart", level: str = "in_process", user=None, **kw) -> Command:
    return Command.objects.create(job=job, kind=kind, level=level, issued_by=user, **kw)


def populated_job(now: datetime, *, ranks: int = 2) -> Job:
    """A running job 10 minutes old with one in-process recovery, saves every 20 s and a few faults."""
    job = make_job(now=now, spec=JobSpec(procs_per_node=ranks, steps=400).to_dict())
    for r in range(ranks):
        make_rank(job, r, now=now, node="node-a" if r < ranks / 2 else "node-b")
    start = job.first_step_at
    for i in range(25):
        make_checkpoint(job, 20 * (i + 1), started_at=start + timedelta(seconds=20 * (i + 1)))
    make_checkpoint(job, 999, started_at=start + timedelta(seconds=530), state="failed", durable_s=3.0)
    fault_at = start + timedelta(seconds=300)
    cycle = make_cycle(job, "a0-ij0-ip1", fault_at=fault_at)
    make_fault(job, at=fault_at, rank=1, cycle=cycle)
    make_fault(
        job,
        at=start + timedelta(seconds=400),
        rank=0,
        fault_class="hang",
        detected_by="watchdog",
        detection_s=20.0,
    )
    return job
