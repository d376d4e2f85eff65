"""Unbroken's training-side SDK: a few calls that let the control plane see and steer your job.

Level 1 (a few lines in your own loop)::

    import unbroken

    run = unbroken.init()                      # once per process, after your own setup
    for step in range(start, num_steps):
        loss = train_step(next(batches))
        run.step(step + 1, loss=loss.item())   # a heartbeat with the step and loss; commands and drills
        if (step + 1) % 100 == 0:
            with run.phase("checkpoint_save"):  # a slow phase gets the checkpoint timeout, not the step one
                save_checkpoint(step + 1)
        if run.stop_requested():               # an operator pressed Stop (rank-local, never a collective)
            break

Level 2 (your training function is what restarts re-enter; one resume path for every restart layer)::

    @unbroken.entrypoint
    def train(ctx: unbroken.Context):
        ctx.init_process_group()                       # per attempt, never before the entrypoint
        model, optimizer = build(ctx.device)           # e.g. fully_shard(...) + AdamW
        start = ctx.checkpoint.restore(model=model, optim=optimizer)   # the step to resume from
        for step in range(start, num_steps):
            loss = forward_backward(model, step)
            ctx.checkpoint.wait_for_staging()          # an async save's copy ends before the update
            optimizer.step(); optimizer.zero_grad()
            ctx.step(step + 1, loss=loss.item())
            ctx.checkpoint.maybe_save(step + 1)        # async DCP at the job's interval
            if (step + 1) % 500 == 0:
                with ctx.phase("eval"):                # the checkpoint timeout, not the step one
                    evaluate(model)
            if ctx.should_stop():                      # agreed across ranks: all stop at the same step
                break

    if __name__ == "__main__":
        train()

Every call is a no-op when the product did not start the process, so the same script runs under plain
``torchrun`` or ``python`` (Level 2 then only creates the process group). No call raises into your loop,
except a fault drill you asked for.
Without any of these calls (Level 0), the product still supervises the script: see the docs,
"Your own training script" (docs/guides/your-own-script.md).
"""

from __future__ import annotations

if __name__ != "unbroken":  # one module, one name: two would be two copies with their own state
    raise ImportError(f"the SDK is imported as `import unbroken`, not `import {__name__}`")

import contextlib
import functools
import os
import warnings
from collections.abc import Callable
from typing import Any

from trainer import usercode as _usercode
from trainer.fullrun import PHASES, Context
from trainer.fullrun import in_phase as _in_phase
from trainer.fullrun import run as _run_full

__all__ = ["PHASES", "Context", "Run", "checkpoint_dir", "entrypoint", "init", "restart_count"]


_should_stop_warned = False


class Run:
    """The handle ``init()`` returns. Inactive (every call a no-op) outside the product."""

    def __init__(self, impl: _usercode.UserRun | None):
        self._impl = impl
        self._tokens_t: float | None = None

    @property
    def active(self) -> bool:
        """True when the product started this process and reports go to its control plane."""
        return self._impl is not None

    def step(self, step: int, *, loss: float | None = None, tokens: int | None = None) -> None:
        """Report that step ``step`` completed (call once per step, on every rank).

        ``loss``: a Python float (call ``.item()`` on a tensor yourself, where your loop syncs anyway).
        ``tokens``: tokens this rank processed in the step, for tokens/s. Fires due drills and acts on
        commands (stop, in-job restart, fault injection) at this step boundary.

            run.step(step, loss=loss.item(), tokens=batch.numel())
        """
        impl = self._impl
        if impl is None:
            return
        if type(step) is not int or step < 0:
            raise ValueError(f"unbroken: run.step(step={step!r}): step must be a non-negative int")
        tps = None
        if tokens is not None:
            import time

            now = time.perf_counter()
            if self._tokens_t is not None and now > self._tokens_t:
                tps = tokens / (now - self._tokens_t)
            self._tokens_t = now
        impl.ft_heartbeat()
        impl.progress(step, None if loss is None else float(loss), tokens_per_s=tps)

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """A context for a phase that is not a training step: ``checkpoint_save``, ``checkpoint_load``,
        ``eval`` or ``data`` (see ``PHASES``).

            with run.phase("eval"):
                val_loss = evaluate(model)
        """
        return _in_phase(self._impl, name, "run.phase")

    def stop_requested(self) -> bool:
        """True once an operator asked this job to stop. Rank-local (no collective), unlike Level 2's
        ``ctx.should_stop()``: every rank sees it within about two report intervals, not necessarily at
        the same step. To stop all ranks at the same step, all-reduce the flag:

            stop = torch.tensor(int(run.stop_requested()))
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item(): break
        """
        return self._impl is not None and self._impl.stop_requested

    def should_stop(self) -> bool:
        """Deprecated: the rank-local ``stop_requested()`` under its old name (Level 2's
        ``ctx.should_stop()`` is agreed across ranks; this never was). Warns once."""
        global _should_stop_warned
        if not _should_stop_warned:
            _should_stop_warned = True
            warnings.warn("unbroken: run.should_stop() is deprecated: use run.stop_requested() (rank-local; "
                          "all-reduce it to stop every rank at the same step)",
                          DeprecationWarning, stacklevel=2)
        return self.stop_requested()

    def close(self) -> None:
        """Nothing to do: the product closes the run when the code returns. Here for symmetry."""

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def init() -> Run:
    """Connect this process to the control plane (Level 1). Call once, on every rank; calling it again
    returns an equivalent handle.

        run = unbroken.init()
        print(run.active)   # False under plain torchrun: every call is then a no-op
    """
    impl = _usercode.current()
    if impl is not None:
        impl.upgrade()
    return Run(impl)


def restart_count() -> int:
    """How many times ft_launcher restarted this job's ranks in this attempt (0 on the first start)."""
    return int(os.environ.get(_usercode.ENV_RESTART_COUNT, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))


def checkpoint_dir() -> str | None:
    """The directory the product gives this job for checkpoints (kept across restarts), or None
    outside the product. Resume from the newest complete checkpoint you find there."""
    return os.environ.get(_usercode.ENV_CHECKPOINT_DIR) or None


def entrypoint(fn: Callable[[Context], Any]) -> Callable[[], Any]:
    """Decorate your training function ``fn(ctx)`` (Level 2); calling the result with no arguments runs
    ``fn`` as the unit the product's restart layers re-enter (see the module docstring's example). A job
    spec can name it directly: ``"entrypoint": "pkg.train:train"``.

    Rules for ``fn``: create the process group with ``ctx.init_process_group()`` inside it (never
    before: that is refused); build the model, optimizer and data inside it, or make what lives across
    attempts independent of the process group; get all state back from ``ctx.checkpoint.restore``;
    let exceptions propagate (a bare ``except:`` or ``except BaseException`` blocks the restart, and
    ``sys.exit(n)`` ends the job); call ``ctx.step`` on every rank every step.
    """

    @functools.wraps(fn)
    def start() -> Any:
        return _run_full(fn, _usercode.current())

    start.__unbroken_entrypoint__ = True  # type: ignore[attr-defined]
    return start
