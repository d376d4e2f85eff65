"""``python -m trainer.launch``: the one command the control plane starts per node.

    python -m trainer.launch --nnodes N --node-rank R --nproc-per-node P --rdzv-endpoint HOST:PORT \\
        --max-restarts K [--in-job|--no-in-job] --run-dir DIR --job-id ID --attempt A -- <trainer flags>

    python -m trainer.launch ... --entrypoint train.py [--workdir DIR] -- <trainer flags> -- <script args>

    UNBROKEN_JOB_SPEC='{"procs_per_node": 2, ...}' python -m trainer.launch --node-rank R \
        --rdzv-endpoint HOST:PORT --run-dir DIR --job-id ID --attempt A [--report-url URL] [--workdir DIR]

The control plane starts the second form: the job's whole spec in one environment variable
(``trainer.jobspec.ENV_SPEC``), decoded here and in every rank (which inherit it) with the control plane's
own type; the flags carry only what the spec cannot know. The first form (flags) is for a launch by hand.

The ranks run the user's code under ``trainer.shim``: ``--entrypoint``, or without it the built-in demo
job (``trainer/examples/synthetic.py``, a Level-2 example like any user's; the trainer flags --preset,
--steps, --batch-size, --lr, --seed and --log-every become its arguments). A script that cannot start
(syntax error, missing import) ends the launch once with exit status 3 and its traceback as a fault,
instead of a restart per round.

What it does, in order:

1. Validates the trainer flags (same parser as ``python -m trainer.shim``) and the layer timeouts, and refuses
   what the installed NVRx cannot run, before any process starts (exit 2).
2. On node 0 it hosts the app store (rdzv port + 1) and the NVRx Wrapper store (rdzv port + 2), so no
   rank is a single point of failure. Other nodes connect to HOST:PORT+1/+2. The rendezvous itself
   stays on PORT (hosted by the node-0 agent). Ranks also use ephemeral gloo ports and MASTER_PORT.
3. Runs NVRx ``ft_launcher`` in this process with hooks on its agent (--in-job: group restarts up to
   K times, heartbeat timeouts derived from the trainer's), or ``torch.distributed.run``
   with --max-restarts 0 (--no-in-job). Launcher facts (failed rank, exit code/signal, restart
   count, restart duration) go to the control plane as events with source "launcher". A failure whose
   ``--failure-policy`` rule says stop, stop_keep or restart_job is not restarted in-job (exit 4 for the
   stops, so the control plane does not relaunch; the control plane relaunches for restart_job).
4. SIGTERM/SIGINT stop the workers (torchelastic's handlers) and whatever is left of this process's
   tree is terminated before exiting: no orphans. Exit 0 when training succeeded, nonzero otherwise.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import signal
import sys
import time
import warnings
from typing import Any

import psutil

from trainer import nvrx_compat
from trainer.config import TrainConfig, parse_config
from trainer.jobspec import ENV_SPEC, JobSpec
from trainer.policy import Action, Decision, Facts, PolicyError, Rule, parse_rules, signal_name, stops_in_job
from trainer.reporter import Reporter, make_reporter
from trainer.runtime import (ENV_APP_STORE_PORT, ENV_IN_JOB, ENV_STORE_HOST, ENV_WRAPPER_STORE_PORT,
                             host_store, read_hang_stack, take_fault)
from trainer.wire import MAX_EVIDENCE_CHARS, CycleMark, EventKind, FaultClass, Layer, cycle_key, redact

log = logging.getLogger("trainer.launch")

APP_STORE_OFFSET = 1
WRAPPER_STORE_OFFSET = 2
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
    a("--failure-policy", default="", help="the job's failure-policy rules (JSON, trainer/policy.py): a failure "
      "whose rule says stop, stop_keep or restart_job is not restarted in-job")
    return p


# Exit status of a launch whose user code cannot start (retrying it cannot help); 2 = bad flags.
EXIT_CANNOT_START = 3
# Exit status of a launch that a failure-policy rule (stop, stop_keep) ended: the control plane must not relaunch.
EXIT_POLICY_STOP = 4
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


class LauncherHooks:
    """Structured launcher facts from the agent (NVRx 0.4.1 has no callback API, so we wrap two methods).

    ``_monitor_workers`` returning FAILED/UNHEALTHY is detection; ``_restart_workers`` stops the group
    (aborted) and starts a new round (restarted).
    """

    def __init__(self, *, reporter: Reporter, attempt: int, app_store: Any, in_job: bool,
                 rules: tuple[Rule, ...] = (), run_dir: str = "", step_timeout_s: float = 30.0):
        self.reporter, self.attempt, self.app_store, self.in_job = reporter, attempt, app_store, in_job
        self.run_dir, self.step_timeout_s = run_dir, step_timeout_s
        self.restarting_cycle: str | None = None
        self.cannot_start = False  # the user's code failed before training started: no more rounds
        self.rules = rules
        self._matched = [0] * len(rules)  # failures each rule matched in this launch (rounds)
        # A rule said this failure is not restarted in-job: no more rounds; the launch fails (EXIT_POLICY_STOP
        # for stop and stop_keep, so the control plane does not relaunch; status 1 for restart_job, so it does).
        self.policy: Decision | None = None
        self._reported: set[int] = set()

    def install(self, agent_cls: Any) -> None:
        hooks = self
        orig_monitor, orig_restart, orig_stop = (agent_cls._monitor_workers, agent_cls._restart_workers,
                                                 agent_cls._stop_workers)

        def _monitor_workers(agent: Any, wg: Any) -> Any:
            result = orig_monitor(agent, wg)
            try:
                if result.state.name in ("UNHEALTHY", "FAILED"):
                    hooks.on_failure(agent, wg, result)
            except Exception:
                log.exception("launcher hook failed (ignored)")
            return result

        def _stop_workers(agent: Any, wg: Any, *a: Any, **kw: Any) -> Any:
            out = orig_stop(agent, wg, *a, **kw)
            if hooks.restarting_cycle:
                hooks.mark(hooks.restarting_cycle, CycleMark.ABORTED)
            return out

        def _restart_workers(agent: Any, wg: Any) -> Any:
            t0 = time.monotonic()
            out = orig_restart(agent, wg)
            cycle, hooks.restarting_cycle = hooks.restarting_cycle, None
            duration = time.monotonic() - t0
            round_ = agent._worker_group.spec.max_restarts - agent._remaining_restarts
            hooks.mark(cycle, CycleMark.RESTARTED)
            hooks.reporter.event(EventKind.LAUNCHER, {
                "message": f"worker group restarted (round {round_}) in {duration:.2f} s",
                "restart_count": round_, "restart_duration_s": round(duration, 3)}, rank=None)
            return out

        agent_cls._monitor_workers = _monitor_workers
        agent_cls._stop_workers = _stop_workers
        agent_cls._restart_workers = _restart_workers

    def mark(self, cycle: str | None, mark: CycleMark, *, at: float | None = None, step: int | None = None,
             command_id: int | None = None) -> None:
        if cycle:
            data = {"cycle": cycle, "layer": Layer.IN_JOB, "mark": mark, "step": step,
                    "command_id": command_id}
            self.reporter.event(EventKind.CYCLE, {k: v for k, v in data.items() if v is not None},
                                at=at, rank=None)

    def on_failure(self, agent: Any, wg: Any, result: Any) -> None:
        detected_at = time.time()
        spec = wg.spec
        remaining = agent._remaining_restarts
        round_ = spec.max_restarts - remaining
        if round_ in self._reported or self.cannot_start or self.policy is not None:
            return  # the agent may look twice (UNHEALTHY, then FAILED; after a fault that ends the launch)
        self._reported.add(round_)
        facts = take_fault(self.app_store, round_) or {}
        if facts.get("fatal"):
            # The same code fails the same way in every round: end the launch now.
            self.cannot_start = True
            agent._remaining_restarts = remaining = 0
        failures = {int(r): {"exitcode": f.exitcode, "signal": _signal_of(f.exitcode), "pid": f.pid,
                             "local_rank": f.local_rank} for r, f in result.failures.items()}
        desc = ", ".join(f"rank {r}: exit {f['exitcode']}" + (f" ({f['signal']})" if f["signal"] else "")
                         for r, f in sorted(failures.items())) or "no exit (rank monitor reported the group)"
        decision = self._policy(failures, facts) if remaining > 0 else None
        if decision is not None:
            agent._remaining_restarts = remaining = 0
            self.policy = decision
            self.reporter.event(EventKind.LAUNCHER, {
                "message": f"failure policy {decision.why}: not restarting in-job ({desc})",
                "policy_rule": (decision.rule or 0) + 1, "policy_action": decision.action}, rank=None)
        will_restart = self.in_job and remaining > 0
        self.reporter.event(EventKind.LAUNCHER, {
            "message": f"worker group {result.state.name} in round {round_}: {desc}; "
                       + (f"restarting ({remaining - 1} restarts left after this)" if will_restart
                          else "no restarts left"),
            "state": result.state.name, "failures": failures, "restart_count": round_,
            "remaining_restarts": remaining}, rank=None)
        if facts.get("kind") == "command" and will_restart:
            self.restarting_cycle = cycle_key(attempt=self.attempt, restart_count=round_ + 1)
            if facts.get("at"):
                self.mark(self.restarting_cycle, CycleMark.FAULT, at=float(facts["at"]),
                          step=facts.get("step"), command_id=facts.get("command_id"))
            self.mark(self.restarting_cycle, CycleMark.DETECTED, at=detected_at)
            return
        first = min(failures) if failures else None
        rank = facts.get("rank", first)
        own = rank if rank in failures else first  # the exit of the rank whose facts these are
        sig = failures.get(own, {}).get("signal") if own is not None else None
        # A rank whose loop stopped beating wrote its stacks (PacedFt) before ft_launcher's timeout ended it.
        stack = read_hang_stack(self.run_dir, rank, since=detected_at - 2 * self.step_timeout_s - 5) \
            if self.run_dir and type(rank) is int else ""
        code = failures.get(own, {}).get("exitcode") if own is not None else None
        fault = facts.get("fault") or (FaultClass.HANG if stack else _ended_as(sig, code))
        cycle = cycle_key(attempt=self.attempt, restart_count=round_ + 1) if will_restart else None
        self.reporter.event(EventKind.FAULT, {
            "fault": fault, "cycle": cycle, "detected_by": "launcher", "rank": rank,
            "interruption": (f"exit {failures[own]['exitcode']}" + (f" {sig}" if sig else "")
                             if own is not None else result.state.name),
            "message": _with_stack(_with_traceback(facts.get("message") or desc, facts.get("traceback")), rank,
                                   stack),
            **({"step": facts["step"]} if facts.get("step") is not None else {})}, rank=rank)
        if not facts.get("fatal"):  # code that cannot start fails alike everywhere: one fault says it
            workers = [w.global_rank for w in getattr(wg, "workers", ())
                       if getattr(w, "global_rank", None) is not None]
            self._report_peers(failures, round_, cycle, skip=rank, workers=workers,
                               since=detected_at - 2 * self.step_timeout_s - 5)
        if cycle:
            self.restarting_cycle = cycle
            if facts.get("at"):
                self.mark(cycle, CycleMark.FAULT, at=float(facts["at"]), step=facts.get("step"))
            self.mark(cycle, CycleMark.DETECTED, at=detected_at)


    def _report_peers(self, failures: dict[int, dict], round_: int, cycle: str | None, *, skip: Any,
                      workers: list[int] = (), since: float = 0.0) -> None:
        """A fault per other failed rank, with its own exit, facts and (a loop that stopped beating) its
        stacks, and per rank of this node that did not fail but whose loop stopped beating: the control
        plane decides which rank's failure the others echo (a killed rank's exit beside its peers' gloo
        errors; a hung rank beside the peers that wait for it in a collective)."""
        for r in sorted(set(failures) | set(workers)):
            if r == skip:
                continue
            f = failures.get(r)
            stack = read_hang_stack(self.run_dir, r, since=since) if self.run_dir else ""
            if f is None and not stack:
                continue  # alive, and its loop beat: ft_launcher stops it with the group
            own = take_fault(self.app_store, round_, r) or {}
            code, sig = (f["exitcode"], f["signal"]) if f is not None else (None, None)
            exit_words = f"exit {code}" + (f" ({sig})" if sig else "") if f is not None else "no exit yet"
            fault = own.get("fault") or (FaultClass.HANG if stack else _ended_as(sig, code))
            self.reporter.event(EventKind.FAULT, {
                "fault": fault, "cycle": cycle, "detected_by": "launcher", "rank": r,
                "interruption": f"exit {code}" + (f" {sig}" if sig else "") if f is not None else None,
                "message": _with_stack(_with_traceback(own.get("message") or f"rank {r}: {exit_words}",
                                                       own.get("traceback")), r, stack),
                **({"step": own["step"]} if own.get("step") is not None else {})}, rank=r)

    def _policy(self, failures: dict[int, dict], facts: dict) -> Decision | None:
        """The written rule that says this round's failure must not be restarted in-job
        (``policy.stops_in_job``, the control plane's own decision function), counting each rule's matches
        over the launch's rounds."""
        if not self.rules:
            return None
        cases = [Facts(fault_class=facts.get("fault") or _ended_as(f["signal"], f["exitcode"]),
                       exit_code=f["exitcode"] if (f["exitcode"] or 0) > 0 else None,
                       signal=signal_name(f["signal"]) if f["signal"] else None,
                       text=str(facts.get("message") or "")) for f in failures.values()]
        for i, rule in enumerate(self.rules):
            if any(rule.match.matches(c) for c in cases):
                self._matched[i] += 1
        for c in cases:
            d = stops_in_job(self.rules, c, self._matched)
            if d is not None:
                return d
        return None


def _ended_as(sig: str | None, exitcode: int | None) -> FaultClass:
    """The class of a worker's end without facts of its own: killed by a signal, or by an exit of 128+N (how
    a shell or a container runtime reports a signal; 137: the OOM killer); else an exception."""
    return FaultClass.PROCESS_KILLED if sig or (exitcode or 0) >= 128 else FaultClass.EXCEPTION


def _signal_of(exitcode: int | None) -> str | None:
    """The signal that ended a worker (torchelastic's negative exit code), or None (its ``signal_name()``
    says "<N/A>" then)."""
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def _with_stack(message: str, rank: Any, stack: str) -> str:
    if not stack:
        return message
    return redact(f"{message[:1000]}\n\nStacks of rank {rank}'s threads when its heartbeats stopped "
                  f"(faulthandler, most recent call first; ft_launcher then ended it):\n{stack}")[:MAX_EVIDENCE_CHARS]


def _with_traceback(message: str, tb: str | None) -> str:
    return f"{message}\n\n{tb}"[:4000] if tb else message


def _is_resource_tracker(p: psutil.Process) -> bool:
    try:
        return "multiprocessing.resource_tracker" in " ".join(p.cmdline())
    except psutil.Error:
        return False


def sweep_children(timeout_s: float = 5.0, *, spare: int | None = None) -> None:
    """Terminate whatever is left of this process's tree (workers start their own sessions).

    Spared: multiprocessing's resource tracker, which exits by itself once this process and the
    fork server are gone (killing it first made this process's exit handlers relaunch it and print
    a KeyError traceback per semaphore into the job log).
    """
    try:
        children = [c for c in psutil.Process().children(recursive=True)
                    if not _is_resource_tracker(c) and c.pid != spare]  # spare: the node agent, stopped last
    except psutil.Error:
        return
    for c in children:
        try:
            c.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(children, timeout=timeout_s)
    for c in alive:
        try:
            c.kill()
        except psutil.Error:
            pass


def forget_local_copies(cfg: TrainConfig) -> None:
    """Remove the node-local checkpoint copies of this job's earlier attempts (a launcher that was
    killed could not): a job-level restart resumes from the durable checkpoint."""
    if not cfg.local_ckpt_root or not os.path.isdir(cfg.local_ckpt_root):
        return
    mine, prefix = os.path.basename(cfg.local_ckpt_dir), cfg.local_ckpt_prefix
    for name in os.listdir(cfg.local_ckpt_root):
        if name.startswith(prefix) and name[len(prefix):].isdigit() and name != mine:
            shutil.rmtree(os.path.join(cfg.local_ckpt_root, name), ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message=".*pynvml.*")
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="%(asctime)s launcher %(levelname)s %(name)s: %(message)s")
    try:
        ns, trainer_args, cfg = parse(list(sys.argv[1:] if argv is None else argv))
    except ValueError as e:
        print(f"trainer.launch: error: {e}", file=sys.stderr)
        return 2

    def on_signal(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    cfg.run_dir = os.path.abspath(cfg.run_dir)
    os.makedirs(cfg.run_dir, exist_ok=True)
    forget_local_copies(cfg)
    if ns.workdir:
        os.chdir(ns.workdir)  # the ranks (and the fork server) inherit it
    app_port, wrapper_port = ns.rdzv_port + APP_STORE_OFFSET, ns.rdzv_port + WRAPPER_STORE_OFFSET
    os.environ.update({
        "UNBROKEN_RUN_DIR": cfg.run_dir, "UNBROKEN_JOB_ID": cfg.job_id, "UNBROKEN_ATTEMPT": str(cfg.attempt),
        ENV_STORE_HOST: ns.rdzv_host, ENV_APP_STORE_PORT: str(app_port),
        ENV_WRAPPER_STORE_PORT: str(wrapper_port), ENV_IN_JOB: "1" if ns.in_job else "0",
    })
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")

    from trainer.runtime import connect_store  # noqa: F401  (import torch only after validation)
    import torch
    import torch.distributed as dist

    stores: list[Any] = []
    if ns.node_rank == 0:
        stores = [host_store(ns.rdzv_host, app_port), host_store(ns.rdzv_host, wrapper_port)]
        app_store = stores[0]
    else:
        import datetime

        app_store = dist.TCPStore(ns.rdzv_host, app_port, is_master=False, use_libuv=True,
                                  timeout=datetime.timedelta(seconds=300))
    agent = None
    if ns.node_agent and cfg.report_url:
        from trainer.agent import AgentProcess

        agent = AgentProcess(upstream=cfg.report_url, job_id=cfg.job_id, token=cfg.token,
                             spool_dir=os.path.join(cfg.spool_dir, f"node{ns.node_rank}"),
                             interval_s=cfg.report_interval).start()
        os.environ["UNBROKEN_AGENT_URL"] = agent.url  # the ranks (forked after this) report through it
    reporter = make_reporter(url=cfg.report_url, job_id=cfg.job_id, token=cfg.token,
                             source=f"launcher:{ns.node_rank}" if ns.nnodes > 1 else "launcher", rank=None,
                             spool_dir=cfg.spool_dir, interval_s=cfg.report_interval,
                             agent_url=agent.url if agent is not None else "")
    hooks = LauncherHooks(reporter=reporter, attempt=cfg.attempt, app_store=app_store, in_job=ns.in_job,
                          rules=ns.rules, run_dir=cfg.run_dir, step_timeout_s=cfg.step_timeout)
    problem = check_entrypoint(ns.entrypoint) if ns.entrypoint is not None and ns.node_rank == 0 else ""
    if problem:
        log.error("cannot start %s: %s", ns.entrypoint, problem)
        reporter.event(EventKind.FAULT, {"fault": FaultClass.EXCEPTION, "detected_by": "launcher", "message": (
            f"the code failed before training started ({problem}); fix it and start a new job")[:4000]}, rank=None)
        reporter.close(timeout_s=10.0)
        if agent is not None:
            agent.stop()
        return EXIT_CANNOT_START
    pool = None
    if ns.in_job:
        hooks.install(nvrx_compat.launcher_agent_class())
        run_launcher = None
        if ns.fork_ranks or uses_standby(ns):
            from trainer import preload

            # The fork server or the standbys import what every rank imports anyway (trainer.preload): new
            # ranks of an in-job restart start without FSDP2's, DCP's or the script's packages' import time.
            os.environ[preload.ENV] = ",".join(preload.modules_for(ns.entrypoint, os.getcwd()))
        if ns.fork_ranks:
            from trainer.shim import entry

            run_launcher = nvrx_compat.launcher_main_forked(entry, preload=[entry.__module__, preload.__name__])
        elif uses_standby(ns):
            from trainer.standby import ENV_SOCKET, StandbyPool

            pool = StandbyPool(ns.nproc_per_node, skip_first=ns.nproc_per_node).start()
            os.environ[ENV_SOCKET] = pool.address
        name = f"ft_launcher (nvidia-resiliency-ext {nvrx_compat.version_str()})"
        if pool is not None:
            name += f", {ns.nproc_per_node} standby ranks"
        if run_launcher is None:
            run_launcher = nvrx_compat.launcher_main()
        else:
            name += ", ranks forked from a warm fork server"
    else:
        from torch.distributed import run as torchrun
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

        hooks.install(LocalElasticAgent)
        run_launcher = torchrun.main
        name = "torch.distributed.run"
    args = launcher_args(ns, cfg, trainer_args)
    reporter.event(EventKind.LAUNCHER, {
        "message": f"starting {name} on node {ns.node_rank}/{ns.nnodes}, {ns.nproc_per_node} ranks per node, "
                   f"max restarts {ns.max_restarts if ns.in_job else 0}, attempt {cfg.attempt}",
        "node_rank": ns.node_rank, "nnodes": ns.nnodes, "nproc_per_node": ns.nproc_per_node,
        "in_job": ns.in_job, "in_process": cfg.in_process, "max_restarts": ns.max_restarts if ns.in_job else 0,
        "attempt": cfg.attempt, "nvrx": nvrx_compat.version_str(), "torch": torch.__version__,
        "python": platform.python_version()},
        rank=None)
    rc = 1
    t0 = time.monotonic()
    try:
        run_launcher(args)
        rc = 0
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        log.exception("launcher failed")
        rc = 1
    finally:
        if hooks.cannot_start:
            rc = EXIT_CANNOT_START
        elif hooks.policy is not None:  # ft_launcher may return normally after the group it gave up on
            rc = EXIT_POLICY_STOP if hooks.policy.action != Action.RESTART_JOB else (rc or 1)
        if pool is not None:
            pool.stop()
        sweep_children(spare=agent.pid if agent is not None else None)
        if cfg.local_ckpt_dir:  # the node-local copies serve this attempt's in-job restarts only
            shutil.rmtree(cfg.local_ckpt_dir, ignore_errors=True)
        reporter.event(EventKind.LAUNCHER, {
            "message": f"launcher exiting with status {rc} after {time.monotonic() - t0:.1f} s",
            "exit_code": rc}, rank=None)
        reporter.close(timeout_s=10.0)
        if agent is not None:
            agent.stop()
        del stores
    return rc


if __name__ == "__main__":
    sys.exit(main())
