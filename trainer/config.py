"""Trainer configuration: one validated dataclass, derived from the job's spec (``trainer.jobspec``).

A job the control plane starts hands each rank its whole spec in ``ENV_SPEC``; ``parse_config`` decodes it
with the control plane's own type and derives this config from it (``TrainConfig.from_spec``), and then
takes only identity from flags and env (run directory, job id, attempt, ingest URL, token). Without a spec
(a launch by hand, the trainer's tests) the same settings come from flags whose defaults are the spec's:
every default is written once, in ``JobSpec``. Every error names the flag that fixes it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from dataclasses import dataclass, field

from trainer.jobspec import (
    ENV_SPEC,
    IN_PROCESS_HARD_TIMEOUT_S,
    IN_PROCESS_SOFT_TIMEOUT_S,
    LOCAL_CHECKPOINT_ROOT,
    JobSpec,
)
from trainer.wire import CheckpointMode, DrillFault

_SPEC = JobSpec()  # the defaults

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
    preset: str = _SPEC.preset
    steps: int = _SPEC.steps
    batch_size: int | None = None  # per rank; None = the preset's
    lr: float = 1e-3
    seed: int = 0
    device: str = "auto"

    ckpt_interval: int = _SPEC.checkpoint_interval
    ckpt_mode: CheckpointMode = CheckpointMode(_SPEC.checkpoint_mode)
    keep_ckpts: int = _SPEC.keep_checkpoints
    # A node-local directory (shared memory or a local disk) for each rank's copy of its newest async
    # save: an in-job restart's new processes restore from it. "" = none (the durable checkpoint only).
    local_ckpt_root: str = ""

    in_process: bool = _SPEC.in_process
    max_in_process_restarts: int = _SPEC.max_in_process_restarts
    soft_timeout: float = IN_PROCESS_SOFT_TIMEOUT_S
    hard_timeout: float = IN_PROCESS_HARD_TIMEOUT_S
    step_timeout: float = _SPEC.step_timeout_s
    ckpt_timeout: float = _SPEC.checkpoint_timeout_s
    startup_timeout: float = _SPEC.startup_timeout_s
    # Level 0 (a script without the SDK): a rank whose printed step does not move for this long is hung.
    stall_timeout: float = _SPEC.stall_timeout_s

    drills: tuple[Drill, ...] = ()

    report_url: str = ""
    # The node agent the launcher started (UNBROKEN_AGENT_URL): reports go there, report_url when it is away.
    agent_url: str = ""
    report_interval: float = _SPEC.heartbeat_interval_s
    # Each beat's busy_s is the rank's mean work per step over this many seconds (the straggler window).
    straggler_window: float = _SPEC.straggler_window_s
    log_every: int = 10

    run_dir: str = ""
    job_id: str = ""
    attempt: int = 0
    token: str = field(default="", repr=False)
    # The spec this config was derived from ("": flags, no spec).
    spec: JobSpec | None = None

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

    @classmethod
    def from_spec(cls, spec: JobSpec, *, env: dict[str, str], run_dir: str, job_id: str, attempt: int,
                  report_url: str) -> TrainConfig:
        """The rank's settings from the job's spec (every setting) and identity (where, who, which attempt)."""
        copy = spec.local_checkpoint_copy and spec.checkpoint_mode == CheckpointMode.ASYNC
        return cls(
            preset=spec.preset, steps=spec.steps, ckpt_interval=spec.checkpoint_interval,
            ckpt_mode=CheckpointMode(spec.checkpoint_mode), keep_ckpts=spec.keep_checkpoints,
            local_ckpt_root=(env.get("UNBROKEN_LOCAL_CKPT_DIR") or LOCAL_CHECKPOINT_ROOT) if copy else "",
            in_process=spec.in_process, max_in_process_restarts=spec.max_in_process_restarts,
            step_timeout=spec.step_timeout_s, ckpt_timeout=spec.checkpoint_timeout_s,
            startup_timeout=spec.startup_timeout_s, stall_timeout=spec.stall_timeout_s,
            drills=tuple(Drill(step=d.step, fault=DrillFault(d.fault), rank=d.rank, fraction=d.fraction)
                         for d in spec.drills),
            report_url=report_url, agent_url=env.get("UNBROKEN_AGENT_URL", "").rstrip("/"),
            report_interval=spec.heartbeat_interval_s, straggler_window=spec.straggler_window_s,
            run_dir=run_dir, job_id=job_id, attempt=attempt, token=_read_token(env), spec=spec)

    def settings(self) -> dict[str, object]:
        """The settings this rank runs with, by the spec's names (its first event carries them), and the
        digest of the spec it decoded (``spec_sha256``; "" without one)."""
        return {
            "preset": self.preset, "steps": self.steps, "checkpoint_interval": self.ckpt_interval,
            "checkpoint_mode": str(self.ckpt_mode), "keep_checkpoints": self.keep_ckpts,
            "local_checkpoint_copy": bool(self.local_ckpt_root), "in_process": self.in_process,
            "max_in_process_restarts": self.max_in_process_restarts, "step_timeout_s": self.step_timeout,
            "checkpoint_timeout_s": self.ckpt_timeout, "startup_timeout_s": self.startup_timeout,
            "stall_timeout_s": self.stall_timeout,
            "heartbeat_interval_s": self.report_interval, "straggler_window_s": self.straggler_window,
            "drills": [[d.step, str(d.fault), d.rank, d.fraction] for d in self.drills],
            "spec_sha256": hashlib.sha256(self.spec.encode().encode()).hexdigest() if self.spec else "",
        }

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
        run = hashlib.sha1(os.path.abspath(self.run_dir).encode(), usedforsecurity=False).hexdigest()[:10]
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
    a("--preset", default=_SPEC.preset, help="model size: tiny | small | 1b")
    a("--steps", type=int, default=_SPEC.steps)
    a("--batch-size", type=int, default=None, help="per-rank batch size (default: the preset's)")
    a("--lr", type=float, default=1e-3)
    a("--seed", type=int, default=0)
    a("--device", default="auto", help="auto | cpu | cuda (auto: cuda+nccl when available, else cpu+gloo)")
    a("--ckpt-interval", type=int, default=_SPEC.checkpoint_interval,
      help="save every K steps; 0 = only the final/stop checkpoint")
    a("--ckpt-mode", default=_SPEC.checkpoint_mode, choices=[m.value for m in CheckpointMode])
    a("--keep-ckpts", type=int, default=_SPEC.keep_checkpoints)
    a("--local-ckpt-dir", default=None,
      help="node-local directory (e.g. /dev/shm/unbroken) for each rank's copy of its newest async save, which "
           "in-job restarts restore from (env UNBROKEN_LOCAL_CKPT_DIR; empty: off)")
    a("--in-process", action=argparse.BooleanOptionalAction, default=_SPEC.in_process,
      help="NVRx in-process restart (inprocess.Wrapper)")
    a("--max-in-process-restarts", type=int, default=_SPEC.max_in_process_restarts)
    a("--soft-timeout", type=float, default=IN_PROCESS_SOFT_TIMEOUT_S,
      help="in-process: no progress for S s -> restart in process")
    a("--hard-timeout", type=float, default=IN_PROCESS_HARD_TIMEOUT_S,
      help="in-process: no progress for S s -> kill the rank")
    a("--step-timeout", type=float, default=_SPEC.step_timeout_s,
      help="in-job: ft_launcher heartbeat timeout")
    a("--ckpt-timeout", type=float, default=_SPEC.checkpoint_timeout_s,
      help="in-job: how long a save or load may keep a rank silent")
    a("--startup-timeout", type=float, default=_SPEC.startup_timeout_s,
      help="in-job: timeout until the first heartbeat")
    a("--drill", action="append", default=[], metavar="STEP:FAULT:RANK[:FRACTION]",
      help=f"scheduled fault drill (repeatable); FAULT in {', '.join(DrillFault)}; RANK a number or '*'")
    a("--report-url", default=None, help="control plane base URL (env UNBROKEN_REPORT_URL)")
    a("--report-interval", type=float, default=_SPEC.heartbeat_interval_s)
    a("--straggler-window", type=float, default=_SPEC.straggler_window_s,
      help="seconds over which each beat's busy_s (the rank's own work per step) is averaged")
    a("--log-every", type=int, default=10, help="print a log line every N steps (0 = never)")
    a("--run-dir", default=None, help="run directory (env UNBROKEN_RUN_DIR)")
    a("--job-id", default=None, help="job id (env UNBROKEN_JOB_ID)")
    a("--attempt", type=int, default=None, help="job-level restart count (env UNBROKEN_ATTEMPT)")
    return p


# The flags a spec sets (with ``ENV_SPEC`` they are refused: the spec is the one source).
IDENTITY_FLAGS = ("--report-url", "--run-dir", "--job-id", "--attempt", "--log-every")


def parse_config(argv: list[str] | None = None, env: dict[str, str] | None = None) -> TrainConfig:
    env = dict(os.environ if env is None else env)
    argv = list(argv or [])
    ns = build_parser().parse_args(argv)
    attempt_s = env.get("UNBROKEN_ATTEMPT", "0") if ns.attempt is None else str(ns.attempt)
    try:
        attempt = int(attempt_s)
    except ValueError:
        raise ValueError(f"--attempt / UNBROKEN_ATTEMPT must be an integer, got {attempt_s!r}") from None
    report_url = (ns.report_url if ns.report_url is not None else env.get("UNBROKEN_REPORT_URL", "")).rstrip("/")
    run_dir, job_id = ns.run_dir or env.get("UNBROKEN_RUN_DIR", ""), ns.job_id or env.get("UNBROKEN_JOB_ID", "")
    if env.get(ENV_SPEC):
        flags = sorted({a.split("=")[0] for a in argv if a.startswith("--")} - set(IDENTITY_FLAGS))
        if flags:
            raise ValueError(f"{', '.join(flags)}: the job's spec ({ENV_SPEC}) sets this; change the spec instead")
        spec = JobSpec.decode(env[ENV_SPEC])
        return TrainConfig.from_spec(spec, env=env, run_dir=run_dir, job_id=job_id, attempt=attempt,
                                     report_url=report_url)
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
