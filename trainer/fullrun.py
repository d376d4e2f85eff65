"""The SDK's full level (Level 2): the user's training function is what the restart layers re-enter.

``unbroken.entrypoint`` lands here. Under the product (the shim started this process)
the function runs inside the resilience layers (``trainer.resilience``: the NVRx in-process Wrapper
when the job has in-process restarts, ft_launcher heartbeats), and its
``Context`` gives it, per attempt: the process group (``init_process_group``), restore and async DCP
saves of registered state (``checkpoint``), and a per-step call (``step``) that reports, fires drills
and agrees on commands across ranks. Outside the product the context does only what the script needs
to run at all (create the process group) and every other call is a no-op. The built-in demo job is
such a function too (``trainer/examples/synthetic.py``): there is no other training loop.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from trainer.checkpoint import Checkpointer
from trainer.config import TrainConfig
from trainer.control import EXIT_RESTART_IN_JOB, Control, NanLossError, RestartRequested, ack_event
from trainer.runtime import RankEnv, Session, connect_store
from trainer.stacks import exception_text
from trainer.usercode import UserRun
from trainer.wire import (
    SLOW_PHASES,
    CheckpointMode,
    CommandKind,
    CycleMark,
    DrillFault,
    EventKind,
    FaultClass,
    Layer,
    Phase,
)

log = logging.getLogger(__name__)

#: The phases ``Run.phase`` and ``Context.phase`` take. ``checkpoint_save``, ``checkpoint_load`` and
#: ``eval`` are slow: the job's checkpoint timeout applies while in them. ``checkpoint`` is short for
#: ``checkpoint_save``.
PHASES = ("checkpoint_save", "checkpoint_load", "eval", "data", "checkpoint")

PG_BEFORE_ENTRYPOINT = (
    "unbroken: a process group exists before the entrypoint runs. Create it inside the entrypoint with "
    "ctx.init_process_group(), not before it: an in-process restart re-creates it for every attempt.")


def phase_of(name: str, call: str) -> Phase:
    """The wire phase of a user's phase name (one of ``PHASES``); ``call`` names the call in the error."""
    if name not in PHASES:
        raise ValueError(f"unbroken: {call}({name!r}): choose one of {', '.join(PHASES)}")
    return Phase.CHECKPOINT_SAVE if name == "checkpoint" else Phase(name)


def in_phase(impl: UserRun | None, name: str, call: str) -> contextlib.AbstractContextManager[None]:
    """``run.phase`` and ``ctx.phase``: the name checked everywhere, the phase reported under the product
    (a slow one with the checkpoint timeout), nothing outside it."""
    phase = phase_of(name, call)
    if impl is None:
        return contextlib.nullcontext()
    return impl.in_phase(phase, slow=phase in SLOW_PHASES)


@contextlib.contextmanager
def _both(first: contextlib.AbstractContextManager[None],
          second: contextlib.AbstractContextManager[None]) -> Iterator[None]:
    with first, second:
        yield


def pick_device(cfg: TrainConfig, env: RankEnv) -> torch.device:
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is visible; use --device cpu")
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


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


class _RankRng(Stateful):
    """This rank's random state (torch CPU and CUDA, Python's ``random``), saved under a rank-specific
    key: DCP keeps one copy of values that look replicated, so a shared key would give every rank
    rank 0's stream after a restore."""

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            sd["cuda"] = torch.cuda.get_rng_state()
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        torch.set_rng_state(sd["torch"])
        random.setstate(sd["python"])
        if "cuda" in sd and torch.cuda.is_available():
            torch.cuda.set_rng_state(sd["cuda"])


class _AppState(Stateful):
    """Model + optimizer (FSDP2-aware, through get/set_state_dict), the user's other Stateful objects,
    this rank's RNG, and the step."""

    def __init__(self, *, model: Any, optim: Any, extra: dict[str, Any], rank: int):
        self.model, self.optim, self.extra, self.rank = model, optim, extra, rank
        self.rng = _RankRng()
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"step": self.step, f"rng/rank{self.rank}": self.rng.state_dict()}
        if self.model is not None:
            msd, osd = get_state_dict(self.model, self.optim if self.optim is not None else [])
            sd["model"] = msd
            if self.optim is not None:
                sd["optim"] = osd
        for name, obj in self.extra.items():
            sd[f"extra/{name}"] = obj.state_dict()
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if self.model is not None:
            set_state_dict(self.model, self.optim if self.optim is not None else [],
                           model_state_dict=sd["model"], optim_state_dict=sd.get("optim") or {})
        for name, obj in self.extra.items():
            obj.load_state_dict(sd[f"extra/{name}"])
        rng = sd.get(f"rng/rank{self.rank}")
        if rng is not None:
            self.rng.load_state_dict(rng)
        self.step = int(sd["step"])


class CheckpointAPI:
    """``ctx.checkpoint``: restore once per attempt, then ``maybe_save(step)`` every step."""

    def __init__(self, ctx: Context | None):
        self._ctx = ctx
        self._state: _AppState | None = None
        self._checkpointer: Checkpointer | None = None
        self._overlap = False  # the loop calls wait_for_staging(): staging may overlap the next step
        #: Where ``restore`` got the state: "memory" (an in-process restart, from the newest async
        #: save's staged copy, when every rank holds the same step), "disk", or None (a fresh start).
        self.restored_from: str | None = None

    def restore(self, *, model: Any = None, optim: Any = None, **stateful: Any) -> int:
        """Register what a checkpoint holds and load the newest state; return the step to resume from
        (0 on a fresh start). After an in-process restart the state comes from memory (the newest async
        save's staged copy) when every rank has it, else from the newest durable checkpoint.
        ``model``/``optim``: your (FSDP2) module and optimizer; any other keyword: an object with
        ``state_dict()``/``load_state_dict()`` (a data loader, a scheduler).

            start = ctx.checkpoint.restore(model=model, optim=optimizer, sampler=sampler)
        """
        ctx = self._ctx
        if ctx is None:
            return 0
        if ctx._ckpt_pg is None:
            raise RuntimeError("unbroken: call ctx.init_process_group() before ctx.checkpoint.restore(...)")
        bad = [k for k, v in stateful.items() if not isinstance(v, Stateful)]
        if bad:
            raise TypeError(f"unbroken: ctx.checkpoint.restore({bad[0]}=...): needs state_dict() and "
                            "load_state_dict() (torch.distributed.checkpoint.stateful.Stateful)")
        s = ctx._session
        self._state = _AppState(model=model, optim=optim, extra=stateful, rank=dist.get_rank())
        self._checkpointer = Checkpointer(root=s.cfg.ckpt_dir, mode=s.cfg.ckpt_mode, keep=s.cfg.keep_ckpts,
                                          pg=ctx._ckpt_pg, report=s.reporter.event, atomic=ctx._scope.atomic,
                                          memory=s.snapshot, local_dir=s.cfg.local_ckpt_dir)
        s.checkpointer = self._checkpointer
        s.reporter.heartbeat(step=0, phase=Phase.CHECKPOINT_LOAD)
        with ctx._impl.keep_alive(), ctx._held():  # type: ignore[union-attr]
            start = self._checkpointer.load(self._state) or 0
        self.restored_from = self._checkpointer.restored_from
        s.mark(ctx._cycle, CycleMark.CHECKPOINT_LOADED, step=start, restored_from=self.restored_from)
        return start

    def wait_for_staging(self) -> None:
        """Call right before ``optimizer.step()``: an async save's copy of the state must be finished
        before the step changes it. Costs nothing when no save is being staged."""
        self._overlap = True
        if self._checkpointer is not None:
            self._checkpointer.maybe_wait_for_staging()

    @property
    def in_flight(self) -> bool:
        """True while an async save is being written: the steps it overlaps are the save's interference
        (the job page books their extra time to the checkpoint)."""
        return self._checkpointer is not None and self._checkpointer.in_flight

    def maybe_save(self, step: int) -> bool:
        """Save (async, per the job's checkpoint settings) when ``step`` is on the interval; True if it did."""
        ctx = self._ctx
        if ctx is None or self._checkpointer is None or self._state is None:
            return False
        interval = ctx._session.cfg.ckpt_interval
        if not interval or step % interval:
            return False
        self.save(step)
        return True

    def save(self, step: int, *, sync: bool = False) -> None:
        """Save now (``sync=True``: wait until it is durable)."""
        ctx = self._ctx
        if ctx is None or self._checkpointer is None or self._state is None:
            return
        mode = CheckpointMode.SYNC if sync else None
        if sync or ctx._session.cfg.ckpt_mode == CheckpointMode.SYNC:
            ctx._session.reporter.heartbeat(step=step, phase=Phase.CHECKPOINT_SAVE)
        with ctx._impl.keep_alive(), ctx._held():  # type: ignore[union-attr]
            self._checkpointer.save(self._state, step, mode=mode)
        if not self._overlap:  # nobody waits before optimizer.step(): finish the copy now
            self._checkpointer.maybe_wait_for_staging()

    def _close(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.wait()
            self._checkpointer.close()
            self._ctx._session.checkpointer = None  # type: ignore[union-attr]
            self._checkpointer = None


class Context:
    """What the entrypoint receives, once per attempt: ``rank``, ``world_size``, ``device``,
    ``iteration``, ``init_process_group()``, ``step(...)``, ``checkpoint``, ``phase(...)`` and
    ``should_stop()``. Outside the product only ``init_process_group`` does anything."""

    def __init__(self, *, session: Session | None, scope: Any, impl: UserRun | None, pacer: Any = None):
        self._session, self._scope, self._impl = session, scope, impl
        self._pacer = pacer  # the in-process layer's progress (ProgressMark)
        self._iteration: int = getattr(scope, "iteration", 0)
        self._ckpt_pg: Any = None
        self._ctl_pg: Any = None
        self._control: Control | None = None
        self._stop = False
        self._last_t: float | None = None
        self._first = True
        self.checkpoint = CheckpointAPI(self if session is not None else None)
        self._cycle = session.cycle(self._iteration) if session is not None else None
        if impl is not None:
            impl.busy.reset()
        if session is not None:
            session.iteration = self._iteration
            if self._iteration > 0:
                session.reporter.event(EventKind.RANK_STARTED, {
                    "iteration": self._iteration, "restart_count": session.env.restart_count,
                    "world_size": int(os.environ["WORLD_SIZE"]), "pid": os.getpid(),
                    "initial_rank": session.env.initial_rank})
                session.ft.start()

    @property
    def iteration(self) -> int:
        """How many in-process restarts came before this attempt (0 on the first)."""
        return self._iteration

    @property
    def rank(self) -> int:
        """This process's rank in the default process group (``RANK`` before it exists)."""
        return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))

    @property
    def world_size(self) -> int:
        """The number of ranks (``WORLD_SIZE`` before the process group exists)."""
        return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))

    @property
    def device(self) -> torch.device:
        """The device this rank trains on: its GPU (``LOCAL_RANK``) where the job uses CUDA, else the CPU."""
        if self._session is not None:
            return self._session.device
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")

    def init_process_group(self) -> None:
        """The default process group for this attempt (NCCL on GPU, gloo on CPU), on a fresh store prefix."""
        if self._session is None:
            if not dist.is_initialized():
                dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
            return
        self._ckpt_pg, self._ctl_pg = init_distributed(self._session, self._iteration)
        s = self._session
        rank = dist.get_rank()
        self._control = Control(inbox=s.inbox if rank == 0 else None, pg=self._ctl_pg, rank=rank,
                                world_size=dist.get_world_size(), in_process=s.cfg.in_process,
                                in_job=s.env.in_job,
                                ack=lambda cid, ok, detail: s.reporter.event(*ack_event(cid, ok, detail)),
                                store=s.app_store)

    def step(self, step: int, *, loss: float | None = None, tokens: int | None = None) -> None:
        """Report step ``step`` completed; every rank calls it once per step (ranks agree on commands
        with one tiny broadcast, collected a step later so that no rank waits for the slowest here).
        A non-finite ``loss`` is a fault: the attempt restarts from the last durable checkpoint."""
        s = self._session
        if s is None:
            return
        impl = self._impl
        assert impl is not None
        if self._control is None:
            raise RuntimeError("unbroken: call ctx.init_process_group() before ctx.step(...)")
        if self.checkpoint._checkpointer is not None:  # commit a finished save before anything can fail
            self.checkpoint._checkpointer.poll()
        rank = dist.get_rank()
        # Completed: a fault from here on (a drill, a NaN) is at this step, in the session's facts and in
        # the user-code run's (whose record_fault reports its step_no).
        s.last_step = impl.step_no = step
        for d in impl.drills.due(step, rank=rank):
            if d.fault == DrillFault.SLOW_RANK:  # not a fault: this rank is slower from now on
                log.warning("rank %s: drill %s: %d %% slower from step %s", rank, d.key, d.fraction * 100, step)
                impl.busy.slow_fraction = d.fraction
            elif d.fault == DrillFault.NAN_LOSS:
                s.record_fault(FaultClass.NAN_LOSS, f"drill {d.key}")
                loss = float("nan")
            else:
                impl.drills.fire(d.fault, rank=rank, hang_pg=self._ctl_pg, world_size=dist.get_world_size(),
                                 message=f"drill {d.key}")
        if loss is not None and not math.isfinite(loss):
            s.record_fault(FaultClass.NAN_LOSS, f"loss {loss} at step {step}")
            raise NanLossError(f"loss is {loss} at step {step}")
        now = time.perf_counter()
        self._pacer.tick()  # every attempt of a session has one (run)
        s.ft.heartbeat()
        busy = impl.busy.step()
        dt = None if self._last_t is None else now - self._last_t
        self._last_t = now
        s.reporter.heartbeat(step=step, phase=Phase.TRAIN, loss=loss, step_time_s=dt,
                             tokens_per_s=tokens / dt if tokens and dt else None, busy_s=busy)
        impl.step_no, impl.loss = step, loss
        s.last_loss = loss
        if self._first:
            self._first = False
            s.mark(self._cycle, CycleMark.FIRST_STEP, step=step)
        decision = self._control.agree_overlapped(step, dt)
        if decision.kind is None:
            return
        if decision.stop:
            self._stop = True
        elif decision.kind == CommandKind.RESTART:
            s.record_fault("command", f"restart command {decision.command_id}", kind="command",
                           command_id=decision.command_id)
            if decision.level == Layer.IN_PROCESS:
                raise RestartRequested(f"restart command {decision.command_id} (in_process)")
            s.reporter.heartbeat(step=step, phase=Phase.RESTARTING)
            s.reporter.close(timeout_s=5.0)
            os._exit(EXIT_RESTART_IN_JOB)
        elif decision.kind == CommandKind.INJECT_FAULT and decision.rank in (rank, -1):
            if decision.fault == DrillFault.SLOW_RANK:
                log.warning("rank %s: command %s: 30 %% slower from step %s", rank, decision.command_id, step)
                impl.busy.slow_fraction = 0.3
                return
            if decision.fault == DrillFault.NAN_LOSS:
                s.record_fault(FaultClass.NAN_LOSS, f"command {decision.command_id}")
                raise NanLossError(f"injected NaN loss (command {decision.command_id})")
            impl.drills.fire(decision.fault, rank=rank, hang_pg=self._ctl_pg, world_size=dist.get_world_size(),
                             message=f"command {decision.command_id}")

    def should_stop(self) -> bool:
        """True once an operator asked the job to stop; the same answer on every rank at the same step
        (agreed in ``step``). Save and return: ``ctx.checkpoint.save(step, sync=True)``."""
        return self._stop

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """A context for a phase that is not a training step: ``checkpoint_save``, ``checkpoint_load``,
        ``eval`` or ``data`` (see ``unbroken.PHASES``). The rank's heartbeats carry it, so a slow one
        (``eval``, a checkpoint of your own) gets the job's checkpoint timeout instead of the step timeout
        from the control plane, ft_launcher and the in-process layer (whose hang timeouts otherwise run
        from the last ``step``).

            with ctx.phase("eval"):
                val_loss = evaluate(model)
        """
        phase = phase_of(name, "ctx.phase")
        if self._session is None:
            return contextlib.nullcontext()
        slow = phase in SLOW_PHASES
        inner = contextlib.nullcontext() if self._impl is None else self._impl.in_phase(phase, slow=slow)
        return _both(inner, self._held()) if slow else inner

    def _held(self) -> contextlib.AbstractContextManager[None]:
        """The in-process layer keeps hearing from the rank through a slow phase, up to the checkpoint
        timeout (as ft_launcher does: ``UserRun.keep_alive``)."""
        if self._pacer is None or self._session is None:
            return contextlib.nullcontext()
        return self._pacer.held(time.monotonic() + self._session.cfg.ckpt_timeout)

    def _finish(self) -> None:
        """The entrypoint returned: finish the in-flight save, leave the process groups."""
        if self._session is None:
            return
        self.checkpoint._close()
        if self._control is not None:
            self._control.drain()
        if self._ctl_pg is not None:
            dist.barrier(group=self._ctl_pg)
        if dist.is_initialized():
            dist.destroy_process_group()


def run(fn: Callable[[Context], Any], impl: UserRun | None) -> Any:
    """Run ``fn`` as the unit the restart layers re-enter (see the module docstring)."""
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(PG_BEFORE_ENTRYPOINT)
    if impl is None:
        return fn(Context(session=None, scope=None, impl=None))
    from trainer.liveness import NullFt, ProgressMark
    from trainer.resilience import wrap_loop

    impl.upgrade(level=2)
    cfg, env = impl.cfg, impl.env
    # Started alone (no trainer.launch hosting the stores): rank 0 hosts the app store.
    app_store = impl.app_store if impl.app_store is not None else connect_store(env, env.app_store_port)
    session = Session(cfg=cfg, env=env, reporter=impl.reporter, app_store=app_store,
                      ft=impl.ft or NullFt(), inbox=impl.inbox if env.initial_rank == 0 else None,
                      device=pick_device(cfg, env))

    pacer = ProgressMark()

    def attempt(scope: Any) -> Any:
        ctx = Context(session=session, scope=scope, impl=impl, pacer=pacer)
        pacer.arm(scope)
        try:
            result = fn(ctx)
        except BaseException as e:
            # Its frames, taken while they exist (the in-process layer hands the exception on without them).
            with contextlib.suppress(Exception):
                e._unbroken_traceback = exception_text(e, (cfg.token,))  # type: ignore[attr-defined]
            raise
        finally:
            pacer.disarm()
        ctx._finish()
        return result

    try:
        return wrap_loop(session, attempt)()
    finally:
        pacer.stop()
