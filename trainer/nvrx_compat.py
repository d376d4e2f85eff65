"""The one seam between this project and the installed nvidia-resiliency-ext (NVRx) release.

Tested against 0.4.1, 0.6.0 and 0.7.0 (``SUPPORTED``; `make test` runs the trainer's NVRx tests against
each, in its own environment). Newer releases rename launcher flags (``--ft-param-*`` -> ``--ft-*``),
deprecate some (``--ft-restart-policy`` in 0.6), add or drop Wrapper arguments, add features (0.6: stop restarting
when restarts make no progress), and may move or remove the in-process package; everything that depends
on those details goes through here:

- ``version()``: the installed release as a tuple; ``parse_version(text)`` for a declared one.
- ``spec_problems(version, ...)``: a job's NVRx options checked against a release, by field (the control
  plane checks a job before it starts with it; ``check_supported`` checks the installed release).
- ``wrapper_kwargs(**kw)``: Wrapper arguments filtered to what this release's constructor accepts
  (a required one missing raises, naming the setting).
- ``launcher_flag(name)``: the spelling of an ft_launcher flag this release understands.
- ``check_supported(in_process=, in_job=)``: refuse a config the release cannot run, with
  the flag that turns the feature off.
- ``launcher_main_forked(entrypoint)``: ft_launcher's ``main`` with the ranks started as a Python
  callable from a warm fork server, where the release has the torchrun-style API for it (else None);
  it keeps 0.6's worker cleanup from killing the launcher's own process group, which the forked ranks share.
- ``in_process_wrapper(cpu=, **kw)``: the Wrapper, without 0.6's NVML health-check chain on a CPU job.
- ``child_pythonpath(own, inherited)``: a started trainer keeps the parent's choice of release.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import os
import re
from typing import Any

MIN_VERSION = (0, 4, 1)
SUPPORTED = ("0.4.1", "0.6.0", "0.7.0")  # each tested in CI in its own environment (README: "NVRx versions")

# Job options that exist only from some release on: option -> (first release, what it is in NVRx).
ONLY_FROM: dict[str, tuple[tuple[int, int, int], str]] = {
    "max_no_progress_restarts": ((0, 6, 0), "ft_launcher's --ft-max-no-progress-cycles"),
}
# Launcher settings a release deprecates: not passed from that release on (its default is our value).
_DEPRECATED_FROM: dict[str, tuple[int, int, int]] = {
    "restart_policy": (0, 6, 0),  # only any-failed is left, and it is the default
}
# The file (in the checkpoint directory) holding the newest durable step, which ft_launcher 0.6+ reads
# to decide whether a restart cycle made progress.
ITERATION_FILE = "latest_checkpointed_iteration.txt"
_VERSION = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?(?:[.+-]?[0-9A-Za-z.]*)?$")

# Settings our resilience layer cannot do without; everything else is optional.
_REQUIRED_WRAPPER_ARGS = ("store_kwargs", "initialize", "abort", "finalize", "soft_timeout", "hard_timeout")


class UnsupportedNvrx(ValueError):
    pass


@functools.cache
def version() -> tuple[int, ...]:
    try:
        raw = importlib.metadata.version("nvidia-resiliency-ext")
    except importlib.metadata.PackageNotFoundError:
        return ()
    return tuple(int(x) for x in re.findall(r"\d+", raw)[:3])


def version_str() -> str:
    return ".".join(map(str, version())) or "not installed"


def parse_version(text: str) -> tuple[int, int, int] | None:
    m = _VERSION.match(text.strip())
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def child_pythonpath(own: list[str], inherited: str | None) -> str:
    """PYTHONPATH for a trainer the control plane or a test starts: this tree's trainer and SDK first,
    then whatever the parent had. The parent's entries may choose the NVRx release (``make
    test-nvrx-next`` and ``make bench-recovery NVRX=`` put 0.6.0's site directory there): dropping them
    would run the trainer with the venv's 0.4.1 while the parent believes it chose 0.6.0."""
    parts = [*own, *(p for p in (inherited or "").split(os.pathsep) if p)]
    return os.pathsep.join(dict.fromkeys(parts))


def spec_problems(nvrx_version: str, *, max_no_progress_restarts: int = 0) -> dict[str, str]:
    """Why a job's NVRx options will not work with release ``nvrx_version``, by option; empty when they
    will. An empty version is not checked (nobody said which release the trainer has)."""
    if not nvrx_version:
        return {}
    v = parse_version(nvrx_version)
    if v is None:
        return {"nvrx_version": f"{nvrx_version!r} is not a version like 0.4.1: write the version of "
                                "nvidia-resiliency-ext installed where the trainer runs"}
    if v < MIN_VERSION:
        return {"nvrx_version": f"the trainer needs NVRx {'.'.join(map(str, MIN_VERSION))} or later "
                                f"(ft_launcher heartbeats, inprocess.Wrapper); this job's NVRx is {nvrx_version}"}
    problems = {}
    options = {"max_no_progress_restarts": max_no_progress_restarts}
    for name, (first, what) in ONLY_FROM.items():
        if options[name] and v < first:
            problems[name] = (f"needs NVRx {'.'.join(map(str, first))} or later ({what}); this job's NVRx is "
                              f"{nvrx_version}: set it to 0, or run a trainer with NVRx "
                              f"{'.'.join(map(str, first))}+")
    return problems


@functools.cache
def has_inprocess() -> bool:
    try:
        mod = importlib.import_module("nvidia_resiliency_ext.inprocess")
    except ImportError:
        return False
    return hasattr(mod, "Wrapper") and hasattr(mod, "CallWrapper")


@functools.cache
def has_fault_tolerance() -> bool:
    try:
        importlib.import_module("nvidia_resiliency_ext.fault_tolerance.launcher")
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient  # noqa: F401
    except ImportError:
        return False
    return True


def check_supported(*, in_process: bool, in_job: bool, max_no_progress_restarts: int = 0) -> None:
    v = version()
    if not v:
        if in_process or in_job:
            raise UnsupportedNvrx("nvidia-resiliency-ext is not installed; install it or pass "
                                  "--no-in-process and --no-in-job")
        return
    if v < MIN_VERSION:
        raise UnsupportedNvrx(f"nvidia-resiliency-ext {version_str()} is older than "
                              f"{'.'.join(map(str, MIN_VERSION))}; upgrade it")
    if in_process and not has_inprocess():
        raise UnsupportedNvrx(f"nvidia-resiliency-ext {version_str()} has no in-process restart "
                              "(inprocess.Wrapper); pass --no-in-process")
    if in_job and not has_fault_tolerance():
        raise UnsupportedNvrx(f"nvidia-resiliency-ext {version_str()} has no ft_launcher; pass --no-in-job")
    problems = spec_problems(version_str(), max_no_progress_restarts=max_no_progress_restarts)
    for name, problem in problems.items():
        raise UnsupportedNvrx(f"--{name.replace('_', '-')}: {problem}")


def wrapper_kwargs(**kw: Any) -> dict[str, Any]:
    from nvidia_resiliency_ext import inprocess

    accepted = set(inspect.signature(inprocess.Wrapper.__init__).parameters)
    missing = [k for k in _REQUIRED_WRAPPER_ARGS if k in kw and k not in accepted]
    if missing:
        raise UnsupportedNvrx(f"inprocess.Wrapper in nvidia-resiliency-ext {version_str()} does not take "
                              f"{', '.join(missing)}; pass --no-in-process")
    return {k: v for k, v in kw.items() if k in accepted}


def in_process_wrapper(*, cpu: bool, **kwargs: Any) -> Any:
    """``inprocess.Wrapper(**kwargs)``; for a CPU job, without NVRx 0.6's GPU health checks. 0.6 chains
    GPU, NVLink and NIC checks (NVML) after ours whenever LOCAL_RANK is set at construction; on a node
    without NVML building them logs NVML tracebacks and running them raises, so every in-process
    restart failed its health check and escalated to an in-job restart. LOCAL_RANK is the release's own
    switch for the chain: hide it while the Wrapper is built (0.4.1 has no chain; the variable is back
    before anything that reads it at run time, such as the finalize step, runs)."""
    from nvidia_resiliency_ext import inprocess

    if not cpu:
        return inprocess.Wrapper(**kwargs)
    saved = os.environ.pop("LOCAL_RANK", None)
    try:
        return inprocess.Wrapper(**kwargs)
    finally:
        if saved is not None:
            os.environ["LOCAL_RANK"] = saved


@functools.cache
def _launcher_options() -> frozenset[str]:
    from nvidia_resiliency_ext.fault_tolerance import launcher

    return frozenset(s for a in launcher.get_args_parser()._actions for s in a.option_strings)


# Preferred spelling first; older releases only know the later ones.
_LAUNCHER_FLAGS: dict[str, tuple[str, ...]] = {
    "workload_check_interval": ("--ft-workload-check-interval", "--ft-param-workload_check_interval"),
    "initial_rank_heartbeat_timeout": ("--ft-initial-rank-heartbeat-timeout",
                                       "--ft-param-initial_rank_heartbeat_timeout"),
    "rank_heartbeat_timeout": ("--ft-rank-heartbeat-timeout", "--ft-param-rank_heartbeat_timeout"),
    "enable_nic_monitor": ("--ft-enable-nic-monitor", "--ft-param-enable-nic-monitor"),
    "restart_policy": ("--ft-restart-policy", "--restart-policy"),
    "log_level": ("--ft-log-level", "--ft-param-log_level"),
    # 0.6+: stop restarting after N restart cycles without progress (read from the iteration file)
    "max_no_progress_cycles": ("--ft-max-no-progress-cycles",),
    "checkpoint_iteration_file": ("--ft-checkpoint-iteration-file",),
}


def launcher_flag(name: str) -> str | None:
    """This release's spelling of an ft_launcher setting, or None if it has none or deprecates it (skip it)."""
    if name in _DEPRECATED_FROM and version() >= _DEPRECATED_FROM[name]:
        return None
    opts = _launcher_options()
    return next((s for s in _LAUNCHER_FLAGS[name] if s in opts), None)


def launcher_main() -> Any:
    from nvidia_resiliency_ext.fault_tolerance import launcher

    return launcher.main


def launcher_main_forked(entrypoint: Any, *, preload: list[str]) -> Any:
    """ft_launcher's ``main`` (same argv, same exit codes) that starts each rank as ``entrypoint(*args)``
    in a process forked from a multiprocessing fork server which imported ``preload`` once, instead of
    a fresh ``python -m trainer.shim`` per rank and restart: an in-job restart then skips ~2 s of imports
    (torch, DTensor, DCP) per rank. Everything after ``-m <module>`` in argv becomes ``args``.

    Needs the release's torchrun-style internals (``parse_args``, ``config_from_args``,
    ``elastic_launch``, a ``start_method`` on the config); returns None where one is missing.
    """
    import multiprocessing
    import sys

    from nvidia_resiliency_ext.fault_tolerance import launcher

    needed = ("parse_args", "config_from_args", "elastic_launch", "_register_ft_rdzv_handler")
    if not all(hasattr(launcher, n) for n in needed):
        return None
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    spawn = importlib.import_module("torch.multiprocessing.spawn")  # the package exports a function of that name

    if not hasattr(spawn.ProcessException, "pid"):
        # NVRx 0.4.1's copy of torchelastic reads ``e.pid`` of a rank that died by a signal; torch
        # names it ``error_pid`` now. Without this, a SIGKILLed rank crashed the launcher.
        spawn.ProcessException.pid = property(lambda self: self.error_pid)

    _spare_own_process_group(launcher)

    def main(argv: list[str]) -> None:
        i = argv.index("-m")
        launcher_argv, script_args = argv[:i], argv[i + 2:]
        args = launcher.parse_args([*launcher_argv, "-m", argv[i + 1]])
        launcher._register_ft_rdzv_handler()
        config, _cmd, _cmd_args = launcher.config_from_args(args)
        if not hasattr(config, "start_method"):
            raise RuntimeError("this ft_launcher has no start_method")
        config.start_method = "forkserver"
        multiprocessing.set_forkserver_preload(preload)
        try:
            launcher.elastic_launch(config=config, entrypoint=entrypoint)(*script_args)
        except ChildFailedError as e:
            launcher.logger.error(f"Some rank(s) exited with non-zero exit code: {e.failures}. "
                                  "Agent's exit code = 1")
            sys.exit(1)
        sys.exit(0)

    return main


def _spare_own_process_group(launcher: Any) -> None:
    """NVRx 0.6's ft_launcher, whenever it stops its workers (each in-job restart, and the end), sends
    SIGTERM and then SIGKILL to every process group its workers are in, taking each worker for the
    leader of its own group (as ``python -m`` workers started by torchrun are). Ranks forked from our
    fork server share the launcher's group, so it killed itself (rc -9) after a clean run and at every
    in-job restart. The workers are already ended when it does this (``pcontext.close``): leave our
    own group out. (0.4.1 kills only orphans, ppid 1, of those groups; leaving ours out changes nothing
    there.)"""
    terminate = getattr(launcher, "terminate_mp_processes", None)
    if terminate is None or getattr(terminate, "spares_own_group", False):
        return

    def terminate_mp_processes(*args: Any, **kwargs: Any) -> None:
        # 0.6: (allowed_pgids); 0.4.1: (allowed_ppids, allowed_pgids), only orphans (ppid 1) of the groups.
        if "allowed_pgids" in kwargs:
            pgids = kwargs["allowed_pgids"] = {p for p in kwargs["allowed_pgids"] if p != os.getpgrp()}
        else:
            pgids = {p for p in args[-1] if p != os.getpgrp()}
            args = (*args[:-1], pgids)
        if pgids:  # 0.6 sleeps 1 s between its SIGTERM and SIGKILL rounds even for no group at all
            terminate(*args, **kwargs)

    terminate_mp_processes.spares_own_group = True  # type: ignore[attr-defined]
    launcher.terminate_mp_processes = terminate_mp_processes


def launcher_agent_class() -> Any:
    from nvidia_resiliency_ext.fault_tolerance import launcher

    return launcher.LocalElasticAgent


def metrics_api() -> tuple[Any, Any] | None:
    """(configure, MetricHandler) of the launcher's torchelastic metrics, or None if this release moved it."""
    try:
        from nvidia_resiliency_ext.fault_tolerance._torch_elastic_compat import metrics
        from nvidia_resiliency_ext.fault_tolerance._torch_elastic_compat.metrics.api import MetricHandler
    except ImportError:
        return None
    return metrics.configure, MetricHandler
