"""Trainer configuration: one validated dataclass built from CLI flags (and env for identity/secrets).

Every error names the flag that fixes it. ``trainer.launch`` parses the same flags to validate a job
before it starts any process and to derive the launcher's timeouts from them.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from dataclasses import dataclass, field

from trainer.wire import CheckpointMode, DrillFault

PRESETS = ("tiny", "small", "1b")
ALL_RANKS = -1


@dataclass(kw_only=True, slots=True, frozen=True)
class Drill:
    """A scheduled fault: fire ``fault`` on ``rank`` (ALL_RANKS for every rank) before step ``step``.
    ``slow_rank`` takes a fourth part, the extra share of each step the rank spends busy from then on
    (``300:slow_rank:1:0.3``: 30 % slower; default 0.3)."""

    step: int
    fault: DrillFault
    rank: int
    fraction: float = 0.3

    @classmethod
    def parse(cls, text: str) -> Drill:
        parts = text.split(":")
        fraction = 0.3
        if len(parts) == 4 and parts[1] == DrillFault.SLOW_RANK:
            try:
                fraction = float(parts[3])
            except ValueError:
                fraction = -1.0
            if not 0 < fraction <= 10:
                raise ValueError(f"--drill {text!r}: FRACTION must be a number within 0..10, e.g. "
                                 "--drill 50:slow_rank:1:0.3 (30 % slower)")
            parts = parts[:3]
        if len(parts) != 3:
            raise ValueError(f"--drill {text!r}: expected STEP:FAULT:RANK, e.g. --drill 12:exception:1 "
                             "(slow_rank: STEP:slow_rank:RANK:FRACTION)")
        step_s, fault_s, rank_s = parts
        try:
            fault = DrillFault(fault_s)
        except ValueError:
            raise ValueError(
                f"--drill {text!r}: unknown fault {fault_s!r}; choose one of {', '.join(DrillFault)}"
            ) from None
        if not step_s.isdigit():
            raise ValueError(f"--drill {text!r}: STEP must be a non-negative integer")
        if rank_s in ("*", "all"):
            rank = ALL_RANKS
        elif rank_s.isdigit():
            rank = int(rank_s)
        else:
            raise ValueError(f"--drill {text!r}: RANK must be a rank number or '*' for every rank")
        return cls(step=int(step_s), fault=fault, rank=rank, fraction=fraction)

    @property
    def key(self) -> str:
        return f"{self.step}:{self.fault}:{'*' if self.rank == ALL_RANKS else self.rank}"


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    preset: str = "tiny"
    steps: int = 100
    batch_size: int | None = None  # per rank; None = the preset's
    lr: float = 1e-3
    seed: int = 0
    device: str = "auto"

    ckpt_interval: int = 10
    ckpt_mode: CheckpointMode = CheckpointMode.ASYNC
    keep_ckpts: int = 2
    # A node-local directory (shared memory or a local disk) for each rank's copy of its newest async
    # save: an in-job restart's new processes restore from it. "" = none (the durable checkpoint only).
    local_ckpt_root: str = ""

    in_process: bool = True
    max_in_process_restarts: int = 16
    soft_timeout: float = 5.0
    hard_timeout: float = 10.0
    step_timeout: float = 30.0
    ckpt_timeout: float = 120.0
    startup_timeout: float = 120.0

    drills: tuple[Drill, ...] = ()

    report_url: str = ""
    # The node agent the launcher started (UNBROKEN_AGENT_URL): reports go there, report_url when it is away.
    agent_url: str = ""
    report_interval: float = 1.0
    # Each beat's busy_s is the rank's mean work per step over this many seconds (the straggler window).
    straggler_window: float = 5.0
    log_every: int = 10

    run_dir: str = ""
    job_id: str = ""
    attempt: int = 0
    token: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"--preset {self.preset!r}: choose one of {', '.join(PRESETS)}")
        if self.steps <= 0:
            raise ValueError("--steps must be > 0")
        if self.batch_size is not None and self.batch_size <= 0:
            raise ValueError("--batch-size must be > 0")
        if not self.lr > 0:
            raise ValueError("--lr must be > 0")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError("--device: choose auto, cpu or cuda")
        if self.ckpt_interval < 0:
            raise ValueError("--ckpt-interval must be >= 0 (0 disables periodic checkpoints)")
        self.ckpt_mode = CheckpointMode(self.ckpt_mode)
        if self.keep_ckpts < 1:
            raise ValueError("--keep-ckpts must be >= 1")
        if self.max_in_process_restarts < 0:
            raise ValueError("--max-in-process-restarts must be >= 0")
        for flag, v in (("--soft-timeout", self.soft_timeout), ("--hard-timeout", self.hard_timeout),
                        ("--step-timeout", self.step_timeout), ("--ckpt-timeout", self.ckpt_timeout),
                        ("--startup-timeout", self.startup_timeout)):
            if not v > 0:
                raise ValueError(f"{flag} must be > 0 seconds")
        # NVRx's monitor process polls every 0.5 s and the progress watchdog every 1 s (see resilience.py);
        # a soft timeout at or below that can never fire reliably.
        if self.soft_timeout < 2.0:
            raise ValueError("--soft-timeout must be >= 2 s (NVRx checks progress every 1 s)")
        if not self.soft_timeout < self.hard_timeout:
            raise ValueError("--hard-timeout must be greater than --soft-timeout")
        if not 1 <= self.straggler_window <= 600:
            raise ValueError("--straggler-window must be within 1..600 seconds")
        if not self.report_interval > 0:
            raise ValueError("--report-interval must be > 0 seconds")
        if self.log_every < 0:
            raise ValueError("--log-every must be >= 0")
        if self.report_url and not self.report_url.startswith(("http://", "https://")):
            raise ValueError("--report-url must start with http:// or https://")
        if self.report_url and not self.job_id:
            raise ValueError("--job-id (or UNBROKEN_JOB_ID) is required with --report-url")
        if not self.run_dir:
            raise ValueError("--run-dir (or UNBROKEN_RUN_DIR) is required")
        if self.attempt < 0:
            raise ValueError("--attempt must be >= 0")
        for d in self.drills:
            if d.step >= self.steps:
                raise ValueError(f"--drill {d.key}: step {d.step} is past --steps {self.steps}")

    def check_layers(self, *, in_job: bool, world_size: int | None = None) -> None:
        """Validate the timeouts between the layers: soft < hard < in-job (ft) timeouts.

        The in-process layer must get its chance before ft_launcher kills the ranks, so the launcher's
        step heartbeat timeout must exceed the hard timeout when both layers are on.
        """
        if in_job and self.in_process and not self.hard_timeout < self.step_timeout:
            raise ValueError(
                "--step-timeout must be greater than --hard-timeout when --in-process and --in-job are both on"
            )
        if in_job and not self.step_timeout < self.startup_timeout:
            raise ValueError("--startup-timeout must be greater than --step-timeout")
        if world_size is not None:
            for d in self.drills:
                if d.rank != ALL_RANKS and d.rank >= world_size:
                    raise ValueError(f"--drill {d.key}: rank {d.rank} does not exist (world size {world_size})")

    @property
    def ckpt_dir(self) -> str:
        return os.path.join(self.run_dir, "checkpoints")

    @property
    def local_ckpt_dir(self) -> str:
        """This job attempt's node-local copies ("" = none); the launcher removes it when it exits."""
        if not self.local_ckpt_root:
            return ""
        return os.path.join(self.local_ckpt_root, f"{self.local_ckpt_prefix}{self.attempt}")

    @property
    def local_ckpt_prefix(self) -> str:
        """The node-local copies' directory name without the attempt: the job and its run directory
        (two control planes on one machine can both have a job 1)."""
        run = hashlib.sha1(os.path.abspath(self.run_dir).encode()).hexdigest()[:10]
        return f"{self.job_id or 'job'}-{run}-a"

    @property
    def spool_dir(self) -> str:
        return os.path.join(self.run_dir, "spool")


def _read_token(env: dict[str, str]) -> str:
    token = env.get("UNBROKEN_TOKEN", "")
    path = env.get("UNBROKEN_TOKEN_FILE", "")
    if not token and path:
        try:
            with open(path, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as e:
            raise ValueError(f"UNBROKEN_TOKEN_FILE={path}: cannot read the job token ({e.strerror})") from None
    return token


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer.shim", description="The flags of one rank of a job.")
    a = p.add_argument
    a("--preset", default="tiny", help="model size: tiny | small | 1b")
    a("--steps", type=int, default=100)
    a("--batch-size", type=int, default=None, help="per-rank batch size (default: the preset's)")
    a("--lr", type=float, default=1e-3)
    a("--seed", type=int, default=0)
    a("--device", default="auto", help="auto | cpu | cuda (auto: cuda+nccl when available, else cpu+gloo)")
    a("--ckpt-interval", type=int, default=10, help="save every K steps; 0 = only the final/stop checkpoint")
    a("--ckpt-mode", default="async", choices=[m.value for m in CheckpointMode])
    a("--keep-ckpts", type=int, default=2)
    a("--local-ckpt-dir", default=None,
      help="node-local directory (e.g. /dev/shm/unbroken) for each rank's copy of its newest async save, which "
           "in-job restarts restore from (env UNBROKEN_LOCAL_CKPT_DIR; empty: off)")
    a("--in-process", action=argparse.BooleanOptionalAction, default=True,
      help="NVRx in-process restart (inprocess.Wrapper)")
    a("--max-in-process-restarts", type=int, default=16)
    a("--soft-timeout", type=float, default=5.0, help="in-process: no progress for S s -> restart in process")
    a("--hard-timeout", type=float, default=10.0, help="in-process: no progress for S s -> kill the rank")
    a("--step-timeout", type=float, default=30.0, help="in-job: ft_launcher heartbeat timeout")
    a("--ckpt-timeout", type=float, default=120.0, help="in-job: how long a save or load may keep a rank silent")
    a("--startup-timeout", type=float, default=120.0, help="in-job: timeout until the first heartbeat")
    a("--drill", action="append", default=[], metavar="STEP:FAULT:RANK[:FRACTION]",
      help=f"scheduled fault drill (repeatable); FAULT in {', '.join(DrillFault)}; RANK a number or '*'")
    a("--report-url", default=None, help="control plane base URL (env UNBROKEN_REPORT_URL)")
    a("--report-interval", type=float, default=1.0)
    a("--straggler-window", type=float, default=5.0,
      help="seconds over which each beat's busy_s (the rank's own work per step) is averaged")
    a("--log-every", type=int, default=10, help="print a log line every N steps (0 = never)")
    a("--run-dir", default=None, help="run directory (env UNBROKEN_RUN_DIR)")
    a("--job-id", default=None, help="job id (env UNBROKEN_JOB_ID)")
    a("--attempt", type=int, default=None, help="job-level restart count (env UNBROKEN_ATTEMPT)")
    return p


def parse_config(argv: list[str] | None = None, env: dict[str, str] | None = None) -> TrainConfig:
    env = dict(os.environ if env is None else env)
    ns = build_parser().parse_args(argv)
    attempt_s = env.get("UNBROKEN_ATTEMPT", "0") if ns.attempt is None else str(ns.attempt)
    try:
        attempt = int(attempt_s)
    except ValueError:
        raise ValueError(f"--attempt / UNBROKEN_ATTEMPT must be an integer, got {attempt_s!r}") from None
    return TrainConfig(
        preset=ns.preset, steps=ns.steps, batch_size=ns.batch_size, lr=ns.lr, seed=ns.seed, device=ns.device,
        ckpt_interval=ns.ckpt_interval, ckpt_mode=ns.ckpt_mode, keep_ckpts=ns.keep_ckpts,
        local_ckpt_root=ns.local_ckpt_dir if ns.local_ckpt_dir is not None else env.get("UNBROKEN_LOCAL_CKPT_DIR", ""),
        in_process=ns.in_process, max_in_process_restarts=ns.max_in_process_restarts,
        soft_timeout=ns.soft_timeout, hard_timeout=ns.hard_timeout, step_timeout=ns.step_timeout,
        ckpt_timeout=ns.ckpt_timeout, startup_timeout=ns.startup_timeout,
        drills=tuple(Drill.parse(d) for d in ns.drill),
        report_url=(ns.report_url if ns.report_url is not None else env.get("UNBROKEN_REPORT_URL", "")).rstrip("/"),
        agent_url=env.get("UNBROKEN_AGENT_URL", "").rstrip("/"),
        report_interval=ns.report_interval, straggler_window=ns.straggler_window, log_every=ns.log_every,
        run_dir=ns.run_dir or env.get("UNBROKEN_RUN_DIR", ""),
        job_id=ns.job_id or env.get("UNBROKEN_JOB_ID", ""),
        attempt=attempt,
        token=_read_token(env),
    )
