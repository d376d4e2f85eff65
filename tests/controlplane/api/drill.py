"""A job with a drill's history, built the way production builds it: heartbeats and events posted to the
ingest endpoint with the job's token, a command issued through the service, the job finished by the
status service. Used by the operator API tests."""

from __future__ import annotations

import time

from controlplane.jobs import services
from controlplane.jobs.models import Job
from tests.controlplane.conftest import batch, ev, hb, make_job

TRACEBACK = (
    'Traceback (most recent call last):\n  File "train.py", line 60, in step\n'
    '    raise RuntimeError("drill")\n'
    "RuntimeError: drill"
)


def _cycle(eid, key, mark, at, layer, **data):
    return ev(eid, "cycle", {"cycle": key, "mark": mark, "layer": layer, **data}, at=at)


def _ckpt(eid, step, state, at, **data):
    return ev(eid, "checkpoint", {"step": step, "state": state, "mode": "async", **data}, at=at, rank=0)


def build(post, settle, *, user, finish: bool = True) -> Job:
    """A 2-rank job, 200 s old: durable saves at 20 and 40, an abandoned save at 60, an in-process
    recovery from an exception on rank 1 at step 60 (resumed from 40), an in-job recovery from a kill
    of rank 0 at step 90 (resumed from 80, saved durably), one operator command."""
    t0 = time.time() - 200
    job, token = make_job(spec={"procs_per_node": 2, "steps": 300}, created_at=_dt(t0), started_at=_dt(t0))
    beats = [hb(r, step=s, at=t0 + 5 + s, step_time_s=0.5, loss=2.0) for s in (1, 30, 59) for r in (0, 1)]
    ip, ij = "a0-ij0-ip1", "a0-ij1"
    events = [
        _ckpt("k20a", 20, "in_flight", t0 + 25), _ckpt("k20b", 20, "durable", t0 + 27, blocking_s=0.05,
                                                        write_s=1.5, bytes=30_000_000, interference_s=0.3),
        _ckpt("k40a", 40, "in_flight", t0 + 45), _ckpt("k40b", 40, "durable", t0 + 47, blocking_s=0.04,
                                                        write_s=1.0, bytes=30_000_000),
        _ckpt("k60a", 60, "in_flight", t0 + 65), _ckpt("k60b", 60, "abandoned", t0 + 65.5),
        _cycle("c1", ip, "fault_at", t0 + 65, "in_process", step=60),
        _cycle("c2", ip, "detected_at", t0 + 65.2, "in_process"),
        _cycle("c3", ip, "aborted_at", t0 + 65.4, "in_process"),
        _cycle("c4", ip, "restarted_at", t0 + 65.6, "in_process"),
        _cycle("c5", ip, "checkpoint_loaded_at", t0 + 66.0, "in_process", step=40),
        _cycle("c6", ip, "first_step_at", t0 + 66.5, "in_process"),
        ev("f1", "fault", {"fault": "exception", "cycle": ip, "detected_by": "in_process", "node": "node-a",
                           "message": "RuntimeError: drill at step 60\n\n" + TRACEBACK},
           at=t0 + 65.2, rank=1),
    ]
    assert post(job, token, batch(beats, events)).status_code == 200
    beats = [hb(r, step=s, at=t0 + 40 + s, step_time_s=0.5, loss=1.5) for s in (70, 90) for r in (0, 1)]
    events = [
        _ckpt("k80a", 80, "in_flight", t0 + 120), _ckpt("k80b", 80, "durable", t0 + 121, blocking_s=0.03,
                                                         write_s=0.9, bytes=30_000_000),
        _cycle("d1", ij, "fault_at", t0 + 131, "in_job", step=90),
        _cycle("d2", ij, "detected_at", t0 + 132, "in_job"),
        _cycle("d3", ij, "restarted_at", t0 + 134, "in_job"),
        _cycle("d4", ij, "checkpoint_loaded_at", t0 + 135, "in_job", step=80),
        _cycle("d5", ij, "first_step_at", t0 + 136, "in_job"),
        ev("f2", "fault", {"fault": "process_killed", "cycle": ij, "detected_by": "launcher",
                           "node": "node-b", "message": "rank 0 killed by SIGKILL"}, at=t0 + 132, rank=0),
    ]
    assert post(job, token, batch(beats, events)).status_code == 200
    beats = [hb(r, step=120, at=t0 + 180, step_time_s=0.5, loss=1.2) for r in (0, 1)]
    assert post(job, token, batch(beats, [])).status_code == 200
    settle()
    job.refresh_from_db()
    services.restart_job(job=job, level="in_process", requested_by=user)
    if finish:
        services.set_status(job, "succeeded", "done")
    return Job.objects.get(pk=job.pk)


def _dt(t: float):
    from datetime import UTC, datetime

    return datetime.fromtimestamp(t, tz=UTC)
