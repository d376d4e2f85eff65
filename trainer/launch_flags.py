"""The launch's command line: what ``python -m trainer.launch`` reads (its flags, or the job's spec in
``trainer.jobspec.ENV_SPEC``: ``parse``) and what it writes (ft_launcher's or torchrun's arguments, each
rank's program: ``launcher_args``), and the check that the user's code can start (``check_entrypoint``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from trainer import nvrx_compat
from trainer.config import TrainConfig, parse_config
from trainer.jobspec import ENV_SPEC, JobSpec
from trainer.policy_rules import PolicyError, parse_rules

MONITOR_INTERVAL_S = 0.5


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer.launch",
                                usage="%(prog)s [launch flags] -- <trainer flags>")
    a = p.add_argument
    a("--nnodes", type=int, default=1)
    a("--node-rank", type=int, default=0)
    a("--nproc-per-node", type=int, default=1)
    a("--rdzv-endpoint", default="127.0.0.1:29400", help="HOST:PORT; PORT+1 and PORT+2 are also used")
    a("--max-restarts", type=int, default=3, help="in-job group restarts (ft_launcher)")
    a("--in-job", action=argparse.BooleanOptionalAction, default=True, help="NVRx ft_launcher in-job restarts")
    a("--max-no-progress-restarts", type=int, default=0,
      help="NVRx 0.6+: stop restarting after this many in-job restarts in a row that saved no newer "
           "checkpoint (0: off)")
    a("--run-dir", default=None)
    a("--job-id", default=None)
    a("--attempt", type=int, default=None)
    a("--report-url", default=None, help="control plane base URL (passed on to the ranks)")
    a("--entrypoint", default=None, help="the user's code: train.py | pkg.module | pkg.module:function")
    a("--workdir", default=None, help="run the user's code in this directory")
    a("--fork-ranks", action=argparse.BooleanOptionalAction,
      default=os.environ.get("UNBROKEN_FORK_RANKS", "0") == "1",
      help="fork each rank from a warm fork server that imported what ranks import: in-job restarts ~2 s "
           "faster, steady steps ~8 %% slower measured on a CPU host (default: UNBROKEN_FORK_RANKS=1, else off)")
    a("--standby-ranks", action=argparse.BooleanOptionalAction,
      default=os.environ.get("UNBROKEN_STANDBY_RANKS", "1") != "0",
      help="keep one started, imported standby process per local rank (trainer/standby.py) for in-job "
           "restarts' new ranks: ~2 s faster restarts on a CPU host, at the memory of one idle Python + torch "
           "process per rank (default on; UNBROKEN_STANDBY_RANKS=0 turns it off)")
    a("--node-agent", action="store_true",
      help="relay the node's ranks' reports through one node agent (trainer/agent.py)")
    a("--failure-policy", default="", help="the job's failure-policy rules (JSON, trainer/policy_rules.py): a "
      "failure whose rule says stop, stop_keep or restart_job is not restarted in-job")
    return p


# What a job without an entrypoint runs: the demo model, through the same shim and SDK as users' code.
BUILTIN_ENTRYPOINT = "trainer.examples.synthetic:train"


def builtin_args(cfg: TrainConfig) -> list[str]:
    """The built-in example's arguments, from the trainer flags that describe the model and its run."""
    args = ["--preset", cfg.preset, "--steps", str(cfg.steps), "--lr", repr(cfg.lr), "--seed", str(cfg.seed),
            "--log-every", str(cfg.log_every)]
    return args + (["--batch-size", str(cfg.batch_size)] if cfg.batch_size else [])


# The launch flags a spec sets (with ENV_SPEC they are refused: the spec is the one source).
_SPEC_LAUNCH_FLAGS = ("--nnodes", "--nproc-per-node", "--max-restarts", "--in-job", "--no-in-job",
                      "--max-no-progress-restarts", "--entrypoint", "--fork-ranks", "--no-fork-ranks",
                      "--node-agent", "--failure-policy")


def _from_spec(ns: argparse.Namespace, spec: JobSpec, own: list[str], trainer_args: list[str]) -> None:
    """The launch settings of a job the control plane started: all from its spec."""
    given = sorted({a.split("=")[0] for a in own if a.startswith("--")} & set(_SPEC_LAUNCH_FLAGS))
    if given:
        raise ValueError(f"{', '.join(given)}: the job's spec ({ENV_SPEC}) sets this; change the spec")
    if trainer_args:
        raise ValueError(f"{' '.join(trainer_args[:3])} ...: with a spec ({ENV_SPEC}) "
                         "there are no trainer flags")
    ns.nnodes, ns.nproc_per_node = spec.nodes, spec.procs_per_node
    ns.max_restarts, ns.in_job = spec.max_restarts_in_job, spec.in_job
    ns.max_no_progress_restarts, ns.node_agent = spec.max_no_progress_restarts, spec.node_agent
    ns.fork_ranks = spec.fork_ranks and spec.in_job
    ns.failure_policy = ""
    ns.rules = spec.failure_policy
    ns.entrypoint = spec.entrypoint or None
    ns.workdir = ns.workdir or spec.working_dir or None
    ns.user_args = list(spec.args)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str], TrainConfig]:
    if "--" in argv:
        i = argv.index("--")
        own, trainer_args = argv[:i], argv[i + 1:]
    else:
        own, trainer_args = argv, []
    ns = build_parser().parse_args(own)
    ns.user_args = []
    spec = JobSpec.decode(os.environ[ENV_SPEC]) if os.environ.get(ENV_SPEC) else None
    if spec is not None:
        _from_spec(ns, spec, own, trainer_args)
    if ns.entrypoint is not None and "--" in trainer_args:
        i = trainer_args.index("--")
        trainer_args, ns.user_args = trainer_args[:i], trainer_args[i + 1:]
    for flag, v in (("--nnodes", ns.nnodes), ("--nproc-per-node", ns.nproc_per_node)):
        if v < 1:
            raise ValueError(f"{flag} must be >= 1")
    if not 0 <= ns.node_rank < ns.nnodes:
        raise ValueError("--node-rank must be in 0..nnodes-1")
    if ns.max_restarts < 0:
        raise ValueError("--max-restarts must be >= 0")
    if ns.max_no_progress_restarts < 0:
        raise ValueError("--max-no-progress-restarts must be >= 0")
    if spec is None:
        try:
            ns.rules = parse_rules(json.loads(ns.failure_policy) if ns.failure_policy else [])
        except (ValueError, PolicyError) as e:
            raise ValueError(f"--failure-policy: {e}") from None
    host, _, port_s = ns.rdzv_endpoint.rpartition(":")
    if not host or not port_s.isdigit() or not 0 < int(port_s) < 65534:
        raise ValueError(f"--rdzv-endpoint {ns.rdzv_endpoint!r}: expected HOST:PORT with PORT < 65534")
    ns.rdzv_host, ns.rdzv_port = host, int(port_s)
    # Our own flags win over the same ones after "--"; env fills what neither gives.
    for flag, v in (("--run-dir", ns.run_dir), ("--job-id", ns.job_id), ("--attempt", ns.attempt),
                    ("--report-url", ns.report_url)):
        if v is not None:
            trainer_args = [*trainer_args, flag, str(v)]
    cfg = parse_config(trainer_args)
    cfg.check_layers(in_job=ns.in_job, world_size=ns.nnodes * ns.nproc_per_node)
    if ns.workdir is not None and not os.path.isdir(ns.workdir):
        raise ValueError(f"--workdir {ns.workdir}: no such directory")
    nvrx_compat.check_supported(in_process=cfg.in_process, in_job=ns.in_job,
                                max_no_progress_restarts=ns.max_no_progress_restarts)
    if ns.entrypoint is None:
        ns.entrypoint, ns.user_args = BUILTIN_ENTRYPOINT, builtin_args(cfg)
    return ns, trainer_args, cfg


def rank_program(ns: argparse.Namespace, trainer_args: list[str]) -> list[str]:
    """What each rank runs: the entrypoint under ``trainer.shim``, in a standby process where the node
    keeps them (``trainer.standby``'s client hands the rank to one)."""
    program = "trainer.standby" if uses_standby(ns) else "trainer.shim"
    return ["-m", program, *trainer_args, "--", ns.entrypoint, *ns.user_args]


def uses_standby(ns: argparse.Namespace) -> bool:
    return bool(ns.in_job and ns.standby_ranks and not ns.fork_ranks)


def check_entrypoint(entrypoint: str) -> str:
    """Why the user's code cannot start (missing script, syntax error with its line, unknown top-level
    package); "" when it may. Runs before any rank starts; nothing of the user's code executes."""
    import importlib.util
    import traceback

    if entrypoint.endswith(".py"):
        if not os.path.isfile(entrypoint):
            return f"the script {entrypoint} does not exist in {os.getcwd()}"
        try:
            with open(entrypoint, "rb") as f:
                compile(f.read(), entrypoint, "exec")
        except SyntaxError as e:
            return f"{entrypoint} does not compile: " + "".join(traceback.format_exception_only(e)).strip()
        return ""
    top = entrypoint.partition(":")[0].split(".")[0]
    sys.path.insert(0, os.getcwd())
    try:
        if importlib.util.find_spec(top) is None:
            return f"no module {top!r} in {os.getcwd()} or the installed packages"
    finally:
        sys.path.pop(0)
    return ""


def launcher_args(ns: argparse.Namespace, cfg: TrainConfig, trainer_args: list[str]) -> list[str]:
    common = [f"--nnodes={ns.nnodes}", f"--node-rank={ns.node_rank}", f"--nproc-per-node={ns.nproc_per_node}",
              "--rdzv-backend=c10d", f"--rdzv-endpoint={ns.rdzv_endpoint}",
              f"--rdzv-id={cfg.job_id or 'unbroken'}-a{cfg.attempt}", f"--monitor-interval={MONITOR_INTERVAL_S}"]
    if not ns.in_job:
        return [*common, "--max-restarts=0", *rank_program(ns, trainer_args)]
    ft: dict[str, str] = {
        "workload_check_interval": str(MONITOR_INTERVAL_S),
        "initial_rank_heartbeat_timeout": str(cfg.startup_timeout),
        "rank_heartbeat_timeout": str(cfg.step_timeout),
        "enable_nic_monitor": "false",  # needs NVML; logs tracebacks on CPU hosts
        "restart_policy": "any-failed",
        # NVRx 0.6+ (skipped before): progress is the newest durable step, which our checkpointer writes to
        # the iteration file; 0 turns the check off (its default, 2, would warn that no file is given).
        "max_no_progress_cycles": str(ns.max_no_progress_restarts),
        "checkpoint_iteration_file": os.path.join(cfg.ckpt_dir, nvrx_compat.ITERATION_FILE),
    }
    out = [*common, f"--max-restarts={ns.max_restarts}"]
    for name, value in ft.items():
        flag = nvrx_compat.launcher_flag(name)
        if flag is not None:
            out.append(f"{flag}={value}")
    return [*out, *rank_program(ns, trainer_args)]
