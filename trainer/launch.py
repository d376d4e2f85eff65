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

The command line is ``trainer.launch_flags``'s (read and written); the hooks on the launcher's agent that
report its facts and apply the failure policy are ``trainer.launcher_hooks``'s.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import shutil
import signal
import sys
import time
import warnings
from typing import Any, Callable

import psutil

from trainer import nvrx_compat
from trainer.config import TrainConfig
from trainer.launch_flags import check_entrypoint, launcher_args, parse, uses_standby
from trainer.launcher_hooks import LauncherHooks
from trainer.policy_rules import Action
from trainer.reporter import Reporter, make_reporter
from trainer.runtime import ENV_APP_STORE_PORT, ENV_IN_JOB, ENV_STORE_HOST, ENV_WRAPPER_STORE_PORT, host_store
from trainer.wire import EventKind, FaultClass

log = logging.getLogger("trainer.launch")

APP_STORE_OFFSET = 1
WRAPPER_STORE_OFFSET = 2


# Exit status of a launch whose user code cannot start (retrying it cannot help); 2 = bad flags.
EXIT_CANNOT_START = 3
# Exit status of a launch that a failure-policy rule (stop, stop_keep) ended: the control plane must not relaunch.
EXIT_POLICY_STOP = 4


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


def _environment(ns: argparse.Namespace, cfg: TrainConfig) -> tuple[int, int]:
    """The run directory, the working directory and the environment every rank inherits (the stores'
    ports: the app store's, the Wrapper store's, returned)."""
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
    return app_port, wrapper_port


def _stores(ns: argparse.Namespace, app_port: int, wrapper_port: int) -> tuple[list[Any], Any]:
    """Node 0 hosts the app store and the Wrapper store (kept alive by the list returned); every node
    gets a client of the app store."""
    import torch.distributed as dist

    from trainer.runtime import connect_store  # noqa: F401  (import torch only after validation)

    if ns.node_rank == 0:
        stores = [host_store(ns.rdzv_host, app_port), host_store(ns.rdzv_host, wrapper_port)]
        return stores, stores[0]
    import datetime

    return [], dist.TCPStore(ns.rdzv_host, app_port, is_master=False, use_libuv=True,
                             timeout=datetime.timedelta(seconds=300))


def _reporting(ns: argparse.Namespace, cfg: TrainConfig) -> tuple[Any, Reporter]:
    """The node agent (``--node-agent``; None without it) and the launcher's reporter."""
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
    return agent, reporter


def _launcher(ns: argparse.Namespace, hooks: LauncherHooks) -> tuple[Callable[[list[str]], Any], str, Any]:
    """The launcher to run, hooked (ft_launcher with --in-job, else torchrun), its name for the event, and
    the standby pool it started (None without one)."""
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
        return run_launcher, name, pool
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    hooks.install(LocalElasticAgent)
    return torchrun.main, "torch.distributed.run", None


def _run(run_launcher: Callable[[list[str]], Any], args: list[str]) -> int:
    """Run the launcher to its end; its exit status (SIGTERM/SIGINT: 128+N, from ``main``'s handler)."""
    try:
        run_launcher(args)
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        log.exception("launcher failed")
        return 1


def _wind_down(rc: int, t0: float, *, cfg: TrainConfig, reporter: Reporter, agent: Any, pool: Any) -> None:
    """After the launcher, however it ended: nothing of this process's tree is left (the node agent last),
    the node-local copies go, and the exit is reported."""
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

    app_port, wrapper_port = _environment(ns, cfg)
    stores, app_store = _stores(ns, app_port, wrapper_port)
    import torch

    agent, reporter = _reporting(ns, cfg)
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
    run_launcher, name, pool = _launcher(ns, hooks)
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
        rc = _run(run_launcher, args)
    finally:
        if hooks.cannot_start:
            rc = EXIT_CANNOT_START
        elif hooks.policy is not None:  # ft_launcher may return normally after the group it gave up on
            rc = EXIT_POLICY_STOP if hooks.policy.action != Action.RESTART_JOB else (rc or 1)
        _wind_down(rc, t0, cfg=cfg, reporter=reporter, agent=agent, pool=pool)
        del stores
    return rc


if __name__ == "__main__":
    sys.exit(main())
