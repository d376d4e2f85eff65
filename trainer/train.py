"""The training loop: set up one restart iteration, resume from the newest durable checkpoint, step.

``run_iteration(session, scope)`` is what the resilience layers wrap (resilience.wrap_loop): it is called
once per in-process restart iteration. ``scope`` is NVRx's CallWrapper (iteration, ping, atomic) or a
no-op stand-in; ``session.ft`` is the in-job liveness client or a no-op.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import socket
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainer.checkpoint import Checkpointer, TrainState
from trainer.control import (EXIT_RESTART_IN_JOB, Control, Drills, NanLossError, RestartRequested, ack_event)
from trainer.model import PRESETS, build_model, make_batch
from trainer.runtime import RankEnv, Session
from trainer.wire import CheckpointMode, CommandKind, CycleMark, EventKind, FaultClass, Layer, Phase

log = logging.getLogger(__name__)


def init_distributed(session: Session, iteration: int) -> tuple[Any, Any]:
    """Default process group on a fresh app-store prefix, plus two gloo groups of our own.

    The checkpoint group keeps async DCP's collectives off FSDP's group (sharing it deadlocks); the
    control group carries the per-step command agreement without syncing a GPU stream.
    """
    cfg, env = session.cfg, session.env
    prefix = f"pg/a{cfg.attempt}/ij{env.restart_count}/ip{iteration}"
    store = dist.PrefixStore(prefix, session.app_store)
    backend = "nccl" if session.device.type == "cuda" else "gloo"
    # A collective may wait at most this long; the layers' own timeouts are shorter and fire first.
    timeout = datetime.timedelta(seconds=max(60.0, 2 * cfg.step_timeout))
    kwargs: dict[str, Any] = {"device_id": session.device} if backend == "nccl" else {}
    dist.init_process_group(backend, store=store, rank=RankEnv.rank(), world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timeout, **kwargs)
    return dist.new_group(backend="gloo", timeout=timeout), dist.new_group(backend="gloo", timeout=timeout)


def run_iteration(session: Session, scope: Any) -> float | None:
    cfg, env, reporter, ft = session.cfg, session.env, session.reporter, session.ft
    iteration = scope.iteration
    session.iteration = iteration
    rank, world_size = RankEnv.rank(), int(os.environ["WORLD_SIZE"])
    cycle = session.cycle(iteration)
    preset = PRESETS[cfg.preset]
    batch_size = cfg.batch_size or preset.batch_size

    reporter.heartbeat(step=0, phase=Phase.INIT)
    reporter.event(EventKind.RANK_STARTED, {
        "iteration": iteration, "restart_count": env.restart_count, "world_size": world_size,
        "node": socket.gethostname(), "pid": os.getpid(), "initial_rank": env.initial_rank})
    if iteration == 0 and cycle is not None and cycle.layer == Layer.JOB:
        session.mark(cycle, CycleMark.RESTARTED)
    ft.start()
    ckpt_pg, ctl_pg = init_distributed(session, iteration)
    model = build_model(preset, seed=cfg.seed, device=session.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    state = TrainState(model, optimizer)
    checkpointer = Checkpointer(root=cfg.ckpt_dir, mode=cfg.ckpt_mode, keep=cfg.keep_ckpts, pg=ckpt_pg,
                                report=reporter.event, atomic=scope.atomic, section=ft.section)
    session.checkpointer = checkpointer
    control = Control(inbox=session.inbox if rank == 0 else None, pg=ctl_pg, rank=rank, world_size=world_size,
                      in_process=cfg.in_process, in_job=env.in_job,
                      ack=lambda cid, ok, detail: reporter.event(*ack_event(cid, ok, detail)))
    drills = Drills(drills=cfg.drills, run_dir=cfg.run_dir, initial_rank=env.initial_rank,
                    record_fault=session.record_fault)

    reporter.heartbeat(step=0, phase=Phase.CHECKPOINT_LOAD)
    start = checkpointer.load(state) or 0
    session.mark(cycle, CycleMark.CHECKPOINT_LOADED, step=start)
    log.info("rank %d/%d iteration %d round %d: resuming at step %d", rank, world_size, iteration,
             env.restart_count, start)

    tokens = batch_size * preset.seq_len
    loss_v: float | None = None
    step = start
    while step < cfg.steps:
        t0 = time.perf_counter()
        with ft.section("step"):
            drills.before_step(step, rank=rank, hang_pg=ctl_pg, world_size=world_size)
            x, y = make_batch(preset, seed=cfg.seed, step=step, rank=rank, batch_size=batch_size,
                              device=session.device)
            logits = model(x)
            loss = drills.corrupt(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
            # One host sync per step, accepted: a NaN must stop the step before it reaches the weights.
            loss_v = loss.item()
            if not math.isfinite(loss_v):
                session.record_fault(FaultClass.NAN_LOSS, f"loss {loss_v} at step {step}")
                raise NanLossError(f"loss is {loss_v} at step {step}")
            loss.backward()
            checkpointer.maybe_wait_for_staging()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        step += 1
        scope.ping()
        ft.heartbeat()
        dt = time.perf_counter() - t0
        reporter.heartbeat(step=step, phase=Phase.TRAIN, loss=loss_v, step_time_s=dt, tokens_per_s=tokens / dt)
        session.last_step = step
        if step == start + 1:
            session.mark(cycle, CycleMark.FIRST_STEP, step=step)
        if cfg.log_every and step % cfg.log_every == 0 and rank == 0:
            log.info("step %d loss %.4f (%.3f s/step)", step, loss_v, dt)

        checkpointer.poll()
        decision = control.agree()
        if decision.stop or step == cfg.steps:
            if decision.stop:
                log.info("stop command %d: final checkpoint at step %d", decision.command_id, step)
            reporter.heartbeat(step=step, phase=Phase.CHECKPOINT_SAVE)
            checkpointer.save(state, step, mode=CheckpointMode.SYNC)
            break
        if cfg.ckpt_interval and step % cfg.ckpt_interval == 0:
            if cfg.ckpt_mode == CheckpointMode.SYNC:
                reporter.heartbeat(step=step, phase=Phase.CHECKPOINT_SAVE)
            checkpointer.save(state, step)
        if decision.kind == CommandKind.RESTART:
            session.record_fault("command", f"restart command {decision.command_id}", kind="command",
                                 command_id=decision.command_id)
            if decision.level == Layer.IN_PROCESS:
                raise RestartRequested(f"restart command {decision.command_id} (in_process)")
            reporter.heartbeat(step=step, phase=Phase.RESTARTING)
            reporter.close(timeout_s=5.0)
            os._exit(EXIT_RESTART_IN_JOB)  # ft_launcher restarts the group
        if decision.kind == CommandKind.INJECT_FAULT and decision.rank in (rank, -1):
            drills.fire(decision.fault, rank=rank, hang_pg=ctl_pg, world_size=world_size,
                        message=f"command {decision.command_id}")

    checkpointer.wait()
    checkpointer.close()
    session.checkpointer = None
    dist.barrier(group=ctl_pg)
    dist.destroy_process_group()
    ft.stop()
    session.last_loss = loss_v
    reporter.heartbeat(step=step, phase=Phase.STOPPED, loss=loss_v)
    reporter.event(EventKind.RANK_FINISHED, {"step": step, "loss": loss_v})
    return loss_v

