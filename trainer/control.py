"""Commands from the control plane and fault drills.

Commands arrive in ingest responses on every rank's reporter thread, re-sent until acknowledged. Rank 0
is the one authority: its inbox dedupes by id (also across restarts, via ``commands_done.json`` in the
run dir), and about every ``AGREE_EVERY_S`` it broadcasts the next command (5 int64 on a small gloo
group, collected a few steps later) so that all ranks act on it at the same step. Rank 0 acknowledges
before acting, so an in-job exit cannot lose the ack (unsent events are spooled and replayed by the
next process).

Drills fire once per run: a fired drill is written (fsync) to ``drills_fired_r<rank>`` before it fires,
so a restart that resumes from an earlier checkpoint does not fire it again.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainer.config import ALL_RANKS, Drill
from trainer.wire import CommandKind, DrillFault, EventKind, FaultClass, Layer

log = logging.getLogger(__name__)

_KIND_CODE = {CommandKind.STOP: 1, CommandKind.RESTART: 2, CommandKind.INJECT_FAULT: 3}
_LEVEL_CODE = {Layer.IN_PROCESS: 1, Layer.IN_JOB: 2}
_FAULT_CODE = {f: i + 1 for i, f in enumerate(DrillFault)}

FAULT_CLASS_OF_DRILL = {
    DrillFault.EXCEPTION: FaultClass.EXCEPTION,
    DrillFault.HANG: FaultClass.HANG,
    DrillFault.HANG_COLLECTIVE: FaultClass.HANG,
    DrillFault.SIGKILL: FaultClass.PROCESS_KILLED,
    DrillFault.NAN_LOSS: FaultClass.NAN_LOSS,
}

# The SDK's loop agrees on commands about this often (a command waits at most about twice this, plus a
# step). Posting a round wakes gloo's worker thread, and on a node whose cores all run ranks that wake
# is where the scheduler switches: ~2-3 % of posts took 1-5 ms (p50 0.13 ms). At 0.2 s a post came
# every ~4 steps of 45 ms and those waits were the SDK calls' p99 (make bench-sdk); at 0.5 s they are
# rarer than 1 in 100 steps, for at most ~0.6 s more before an agreed command acts.
AGREE_EVERY_S = 0.5

# Exit status of a rank that a restart command (level in_job) tells to leave: ft_launcher restarts the group.
EXIT_RESTART_IN_JOB = 75


class DrillError(RuntimeError):
    """An injected exception (fault drill)."""


class NanLossError(FloatingPointError):
    """A non-finite loss; raised before backward so it never reaches the weights."""


class RestartRequested(RuntimeError):
    """Raised inside the loop on a ``restart`` command at level in_process: the Wrapper restarts."""


class CommandInbox:
    """Pending commands, deduped by id; filled by the reporter thread, drained by the loop (rank 0)."""

    def __init__(self, done_path: str):
        self._path = done_path
        self._lock = threading.Lock()
        self._pending: dict[int, dict[str, Any]] = {}
        try:
            with open(done_path, encoding="utf-8") as f:
                self._done: set[int] = set(json.load(f))
        except (OSError, ValueError):
            self._done = set()
        self._acked: set[int] = set()

    def offer(self, commands: list[dict[str, Any]]) -> None:
        with self._lock:
            for c in commands:
                cid = c.get("id")
                if isinstance(cid, int) and cid not in self._done:
                    self._pending.setdefault(cid, c)

    def take(self) -> dict[str, Any] | None:
        cmd = self.peek()
        if cmd is not None:
            self.done(int(cmd["id"]))
        return cmd

    def peek(self) -> dict[str, Any] | None:
        """The oldest pending command, left pending."""
        with self._lock:
            return self._pending[min(self._pending)] if self._pending else None

    def first_ack(self, cid: int) -> bool:
        """True the first time in this process: a command re-posted after an in-process restart (its
        round was never collected) is acknowledged once."""
        with self._lock:
            first = cid not in self._acked
            self._acked.add(cid)
            return first

    def done(self, cid: int) -> None:
        """Never offer ``cid`` again, in this process or the next one of this rank."""
        with self._lock:
            self._pending.pop(cid, None)
            self._done.add(cid)
            tmp = f"{self._path}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(sorted(self._done), f)
            os.replace(tmp, self._path)


@dataclass(kw_only=True, slots=True, frozen=True)
class Decision:
    command_id: int = 0
    kind: CommandKind | None = None
    level: Layer | None = None
    fault: DrillFault | None = None
    rank: int = ALL_RANKS

    @property
    def stop(self) -> bool:
        return self.kind == CommandKind.STOP


NOTHING = Decision()


def encode(cmd: dict[str, Any], *, in_process: bool, in_job: bool, world_size: int) -> tuple[list[int], str]:
    """A command as 4 int64 ([id, kind, level-or-fault, rank]) and the detail for its ack ("" = ok)."""
    cid = int(cmd["id"])
    try:
        kind = CommandKind(cmd.get("kind"))
    except ValueError:
        return [0, 0, 0, 0], f"unknown command kind {cmd.get('kind')!r}"
    rank = cmd.get("rank")
    if rank is not None and not (isinstance(rank, int) and 0 <= rank < world_size):
        return [0, 0, 0, 0], f"rank {rank!r} does not exist (world size {world_size})"
    target = ALL_RANKS if rank is None else rank
    if kind == CommandKind.STOP:
        return [cid, _KIND_CODE[kind], 0, target], ""
    if kind == CommandKind.RESTART:
        level = cmd.get("level")
        if level == Layer.IN_PROCESS and not in_process:
            return [0, 0, 0, 0], "in-process restart is off for this job (--no-in-process)"
        if level == Layer.IN_JOB and not in_job:
            return [0, 0, 0, 0], "in-job restart is off for this job (--no-in-job)"
        if level not in _LEVEL_CODE:
            return [0, 0, 0, 0], f"restart level {level!r} is not handled by the trainer (use in_process|in_job)"
        return [cid, _KIND_CODE[kind], _LEVEL_CODE[Layer(level)], target], ""
    try:
        fault = DrillFault(cmd.get("fault"))
    except ValueError:
        return [0, 0, 0, 0], f"unknown fault {cmd.get('fault')!r}; one of {', '.join(DrillFault)}"
    return [cid, _KIND_CODE[kind], _FAULT_CODE[fault], target], ""


def decode(v: list[int]) -> Decision:
    cid, kind_c, arg, rank = v
    if cid == 0:
        return NOTHING
    kind = next(k for k, c in _KIND_CODE.items() if c == kind_c)
    level = next((lv for lv, c in _LEVEL_CODE.items() if c == arg), None) if kind == CommandKind.RESTART else None
    fault = next((f for f, c in _FAULT_CODE.items() if c == arg), None) if kind == CommandKind.INJECT_FAULT else None
    return Decision(command_id=cid, kind=kind, level=level, fault=fault, rank=rank)


def _collected_key(command_id: int) -> str:
    return f"unbroken/commands/collected/{command_id}"


class Control:
    """Per-step agreement on the next command: rank 0 decides, one tiny broadcast tells everyone."""

    def __init__(self, *, inbox: CommandInbox | None, pg: Any, rank: int, world_size: int, in_process: bool,
                 in_job: bool, ack: Callable[[int, bool, str], None], store: Any = None):
        self.inbox, self.pg, self.rank, self.world_size = inbox, pg, rank, world_size
        # The job's store, which outlives an attempt: a rank that collects a round says so there, so that
        # rank 0 does not post again a command a peer acted on in a round rank 0 itself never collected
        # (the peer acted first, an injected fault say, and the restart cut rank 0 short).
        self.store = store
        self.in_process, self.in_job, self._ack = in_process, in_job, ack
        self._work: Any = None
        self._posted: torch.Tensor | None = None
        self._bufs = (torch.zeros(5, dtype=torch.int64), torch.zeros(5, dtype=torch.int64))
        self._round = 0
        self._due = 0
        self._every = 1  # steps from a round's post to its collection: rank 0's k, from the last round

    def agree_overlapped(self, step: int, step_time_s: float | None) -> Decision:
        """``agree`` for the SDK's loop, off the step's critical path. A round is posted at step P and
        collected (and acted on, by every rank) at step P + k, so a rank waits only when a peer is more
        than k steps behind. k is about ``AGREE_EVERY_S`` of steps at rank 0's step time: rank 0 puts it
        in every round and every rank takes it from the round it collects, so all ranks keep the same
        schedule (a command waits at most about twice ``AGREE_EVERY_S``). The first round, before any
        step time is known, is collected a step later. Rank 0 marks a command done when its round is
        collected, so one posted in a round that a fault cut short is posted again by the next attempt."""
        decision = NOTHING
        if step < self._due:
            return decision
        if self._work is not None:
            self._work.wait()
            self._work = None
            vec = self._posted.tolist()
            decision = decode(vec[:4])
            self._every = int(vec[4])
            self._collected(decision)
        buf = self._bufs[self._round % 2]
        self._round += 1
        buf.zero_()
        if self.rank == 0:
            cmd = self.inbox.peek() if self.inbox is not None else None
            while cmd is not None and self._collected_by_a_peer(int(cmd["id"])):
                self.inbox.done(int(cmd["id"]))
                cmd = self.inbox.peek()
            if cmd is not None:
                cid = int(cmd["id"])
                vec, detail = encode(cmd, in_process=self.in_process, in_job=self.in_job,
                                     world_size=self.world_size)
                if self.inbox.first_ack(cid):
                    self._ack(cid, not detail, detail or "accepted")
                if detail:
                    self.inbox.done(cid)  # refused: nothing to act on
                buf[:4] = torch.tensor(vec, dtype=torch.int64)
            buf[4] = 1 if not step_time_s else max(1, min(50, int(AGREE_EVERY_S / step_time_s)))
        if self.world_size > 1:
            self._work = dist.broadcast(buf, src=0, group=self.pg, async_op=True)
            self._posted = buf
            self._due = step + self._every
        else:
            self._every = int(buf[4])
            if decision is NOTHING:
                decision = decode(buf.tolist()[:4])
                self._collected(decision)
            self._due = step + self._every
        return decision

    def _collected(self, decision: Decision) -> None:
        if not decision.command_id:
            return
        if self.rank == 0:
            if self.inbox is not None:
                self.inbox.done(decision.command_id)
        elif self.store is not None and decision.kind != CommandKind.STOP:
            # Before acting on it (the act may be an injected fault). A stop is not done until the loop
            # saves and returns: one that a restart cut short is posted again.
            try:
                self.store.set(_collected_key(decision.command_id), "1")
            except Exception:  # the store is gone with the attempt: rank 0 may post it again
                log.warning("command %s: could not record its collection", decision.command_id, exc_info=True)

    def _collected_by_a_peer(self, cid: int) -> bool:
        if self.store is None or self.world_size == 1:
            return False
        try:
            return bool(self.store.check([_collected_key(cid)]))
        except Exception:  # noqa: BLE001 - no store, no record: post it (acted on at least once)
            return False

    def drain(self) -> None:
        """Collect an outstanding overlapped broadcast (before the group goes away)."""
        if self._work is not None:
            self._work.wait()
            self._work = None


class Drills:
    """Scheduled (``--drill``) and commanded fault injection."""

    def __init__(self, *, drills: tuple[Drill, ...], run_dir: str, initial_rank: int,
                 record_fault: Callable[[FaultClass, str], None]):
        self._drills = drills
        self._path = os.path.join(run_dir, f"drills_fired_r{initial_rank}")
        self._record_fault = record_fault
        try:
            with open(self._path, encoding="utf-8") as f:
                self._fired = {line.strip() for line in f if line.strip()}
        except OSError:
            self._fired = set()

    def due(self, step: int, *, rank: int) -> list[Drill]:
        """Drills for ``rank`` at or before ``step`` not fired yet, marked fired (user code reports
        steps when it likes, so a drill fires at the first report at or past its step)."""
        out = [d for d in self._drills if d.step <= step and d.rank in (rank, ALL_RANKS) and d.key not in self._fired]
        for d in out:
            self._remember(d.key)
        return out

    def fire(self, fault: DrillFault, *, rank: int, hang_pg: Any, world_size: int, message: str) -> None:
        log.warning("rank %s: injecting %s (%s)", rank, fault, message)
        self._record_fault(FAULT_CLASS_OF_DRILL[fault], message)
        if fault == DrillFault.EXCEPTION:
            raise DrillError(f"injected exception on rank {rank} ({message})")
        if fault == DrillFault.HANG:
            while True:  # a Python-level hang: the interpreter runs, the step does not move
                time.sleep(0.05)
        if fault == DrillFault.HANG_COLLECTIVE:
            # A collective that no peer joins: blocked inside gloo/NCCL with the GIL released.
            if world_size > 1:
                dist.barrier(group=hang_pg)
            time.sleep(1e9)  # one C call (also what a 1-rank world gets)
        if fault == DrillFault.SIGKILL:
            os.kill(os.getpid(), signal.SIGKILL)

    def _remember(self, key: str) -> None:
        self._fired.add(key)
        with open(self._path, "a", encoding="utf-8") as f:
            f.write(key + "\n")
            f.flush()
            os.fsync(f.fileno())


def ack_event(command_id: int, ok: bool, detail: str) -> tuple[EventKind, dict[str, Any]]:
    return EventKind.COMMAND_ACK, {"command_id": command_id, "ok": ok, "detail": detail}
