"""Who this rank is, where the stores are, and the per-process session shared by restart iterations.

Ports (``trainer.launch`` hosts both stores on node 0, outside the ranks, so losing any rank - rank 0
included - never takes them down):

- rdzv port P: the launcher's c10d rendezvous (torchelastic / ft_launcher)
- P+1: the app store (process-group rendezvous per iteration, fault facts, anything the ranks share)
- P+2: the NVRx in-process Wrapper store

Without ``trainer.launch`` (``python -m trainer.shim`` alone) rank 0 hosts both at MASTER_PORT+1/+2.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainer.config import TrainConfig
from trainer.ports import free_port_block
from trainer.reporter import Reporter
from trainer.wire import CycleMark, EventKind, FaultClass, Layer, cycle_key, redact

log = logging.getLogger(__name__)

ENV_STORE_HOST = "UNBROKEN_STORE_HOST"
ENV_APP_STORE_PORT = "UNBROKEN_APP_STORE_PORT"
ENV_WRAPPER_STORE_PORT = "UNBROKEN_WRAPPER_STORE_PORT"
ENV_IN_JOB = "UNBROKEN_IN_JOB"


@dataclass(kw_only=True, slots=True, frozen=True)
class RankEnv:
    initial_rank: int
    world_size: int
    local_rank: int
    restart_count: int  # ft_launcher / torchrun round (TORCHELASTIC_RESTART_COUNT)
    store_host: str
    app_store_port: int
    wrapper_store_port: int
    stores_external: bool
    in_job: bool  # running under ft_launcher with in-job restarts

    @classmethod
    def from_env(cls) -> RankEnv:
        """Read the launcher's env; fill in a 1-rank world when started alone."""
        env = os.environ
        env.setdefault("RANK", "0")
        env.setdefault("WORLD_SIZE", "1")
        env.setdefault("LOCAL_RANK", "0")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in env:
            env["MASTER_PORT"] = str(free_port_block())
        external = ENV_APP_STORE_PORT in env
        mport = int(env["MASTER_PORT"])
        return cls(
            initial_rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env["LOCAL_RANK"]),
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
            store_host=env.get(ENV_STORE_HOST, env["MASTER_ADDR"]),
            app_store_port=int(env.get(ENV_APP_STORE_PORT, mport + 1)),
            wrapper_store_port=int(env.get(ENV_WRAPPER_STORE_PORT, mport + 2)),
            stores_external=external,
            in_job=env.get(ENV_IN_JOB, "0") == "1" and "FT_RANK_MONITOR_IPC_SOCKET" in env,
        )

    @staticmethod
    def rank() -> int:
        """The current rank (the in-process Wrapper may reassign it between iterations)."""
        return int(os.environ["RANK"])


def host_store(host: str, port: int) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, multi_tenant=True,
                         use_libuv=True, timeout=datetime.timedelta(seconds=300))


def connect_store(env: RankEnv, port: int, timeout_s: float = 300.0) -> dist.TCPStore:
    if not env.stores_external and env.initial_rank == 0 and port == env.app_store_port:
        return host_store("0.0.0.0", port)  # noqa: S104 - a shim started alone: rank 0 hosts
    return dist.TCPStore(env.store_host, port, is_master=False, use_libuv=True,
                         timeout=datetime.timedelta(seconds=timeout_s))


def hang_stack_path(run_dir: str, rank: int) -> str:
    """Where a rank's faulthandler writes its threads' stacks when its loop stops beating (``liveness.FtHeartbeats``)."""
    return os.path.join(run_dir, f"hang-stack-r{rank}.txt")


def read_hang_stack(run_dir: str, rank: int, *, since: float, max_chars: int = 2800) -> str:
    """The stacks a hung rank wrote at or after ``since`` (unix seconds), capped; "" when none."""
    path = hang_stack_path(run_dir, rank)
    try:
        if os.path.getmtime(path) < since:
            return ""
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read().strip()
    except OSError:
        return ""
    return text if len(text) <= max_chars else text[:max_chars] + "\n..."


def fault_key(restart_count: int) -> str:
    return f"unbroken/fault/ij{restart_count}"


def record_fault_facts(store: Any, restart_count: int, rec: dict[str, Any]) -> None:
    """Leave a fault's facts for whoever reports the cycle (the launcher, or rank 0 in process); the
    first record of a round wins."""
    try:
        store.compare_set(fault_key(restart_count), "", json.dumps(rec))
        if type(rec.get("rank")) is int:  # every rank's own facts too: the launcher reports each failed rank
            store.set(f"{fault_key(restart_count)}/r{rec['rank']}", json.dumps(rec))
    except Exception:
        log.warning("could not record fault facts in the app store", exc_info=True)


def add_traceback(store: Any, restart_count: int, rec: dict[str, Any]) -> None:
    """A drill recorded this rank's fault a moment before it raised (first record wins): add what the
    exception proves (its message and traceback) to that record."""
    key = fault_key(restart_count)
    try:
        if not store.check([key]):
            return
        first = json.loads(store.get(key) or b"{}")
        if first.get("rank") == rec["rank"] and not first.get("traceback"):
            first.update(message=f"{first.get('message', '')}: {rec['message']}"[:500], traceback=rec["traceback"])
            store.set(key, json.dumps(first))
    except Exception:
        log.warning("could not add the traceback to the fault facts", exc_info=True)


def take_fault(store: Any, restart_count: int, rank: int | None = None) -> dict[str, Any] | None:
    """Consume the fault facts recorded by the faulty rank in round ``restart_count`` (first wins), or
    with ``rank``, those that rank recorded itself."""
    key = fault_key(restart_count) + (f"/r{rank}" if rank is not None else "")
    try:
        if not store.check([key]):
            return None
        raw = store.get(key)
        store.delete_key(key)
        return json.loads(raw) if raw else None
    except Exception:  # noqa: BLE001 - facts are best effort; never block a restart on them
        return None


@dataclass(kw_only=True, slots=True)
class Cycle:
    key: str
    layer: Layer


class Session:
    """Per-process state shared by every in-process restart iteration."""

    def __init__(self, *, cfg: TrainConfig, env: RankEnv, reporter: Reporter, app_store: Any, ft: Any,
                 inbox: Any, device: torch.device):
        self.cfg, self.env, self.reporter, self.app_store = cfg, env, reporter, app_store
        self.ft, self.inbox, self.device = ft, inbox, device
        from trainer.checkpoint_copies import MemorySnapshot  # DCP: only in ranks, never in the launcher

        self.checkpointer: Any = None  # the current iteration's, for the finalize hook
        self.snapshot = MemorySnapshot()  # the newest staged state, for in-process restarts
        self.iteration = 0
        self.last_loss: float | None = None
        # The rank's last completed step (the checkpoint's step right after a restore): a fault's facts
        # carry it, so that the control plane counts steps lost from the trainer's own numbers.
        self.last_step = 0

    def cycle(self, iteration: int) -> Cycle | None:
        """The restart cycle this iteration/process start closes, if any."""
        a, rc = self.cfg.attempt, self.env.restart_count
        if iteration > 0:
            return Cycle(key=cycle_key(attempt=a, restart_count=rc, iteration=iteration), layer=Layer.IN_PROCESS)
        if rc > 0:
            return Cycle(key=cycle_key(attempt=a, restart_count=rc), layer=Layer.IN_JOB)
        if a > 0:
            return Cycle(key=cycle_key(attempt=a), layer=Layer.JOB)
        return None

    def mark(self, cycle: Cycle | None, mark: CycleMark, *, step: int | None = None, at: float | None = None,
             rank: int | None = None, command_id: int | None = None, restored_from: str | None = None) -> None:
        if mark == CycleMark.CHECKPOINT_LOADED and step is not None:
            self.last_step = step
        if cycle is None:
            return
        data: dict[str, Any] = {"cycle": cycle.key, "layer": cycle.layer, "mark": mark}
        if step is not None:
            data["step"] = step
        if command_id is not None:
            data["command_id"] = command_id
        if restored_from is not None:
            data["restored_from"] = restored_from
        self.reporter.event(EventKind.CYCLE, data, at=at, **({} if rank is None else {"rank": rank}))

    def record_fault(self, fault: FaultClass | str, message: str, *, kind: str = "fault",
                     command_id: int | None = None, traceback_text: str = "") -> None:
        """Leave the facts only the faulty rank knows (class, time, its last completed step, its traceback;
        for a restart command, the command) for whoever reports the cycle. Redacted of secrets."""
        secrets = (self.cfg.token,)
        rec = {"fault": str(fault), "rank": RankEnv.rank(), "at": time.time(), "iteration": self.iteration,
               "message": redact(message, secrets)[:500], "kind": kind, "step": self.last_step,
               "traceback": redact(traceback_text, secrets)}
        if command_id is not None:
            rec["command_id"] = command_id
        record_fault_facts(self.app_store, self.env.restart_count, rec)
        if traceback_text:
            add_traceback(self.app_store, self.env.restart_count, rec)
