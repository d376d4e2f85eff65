"""The one seam between this project and the installed nvidia-resiliency-ext (NVRx) release.

Tested against 0.4.1. Newer releases rename launcher flags (``--ft-param-*`` -> ``--ft-*``), add or drop
Wrapper arguments, and may move or remove the in-process package; everything that depends on those
details goes through here:

- ``version()``: the installed release as a tuple.
- ``wrapper_kwargs(**kw)``: Wrapper arguments filtered to what this release's constructor accepts
  (a required one missing raises, naming the setting).
- ``launcher_flag(name)``: the spelling of an ft_launcher flag this release understands.
- ``check_supported(in_process=, in_job=)``: refuse a config the release cannot run, with
  the flag that turns the feature off.
- ``launcher_main_forked(entrypoint)``: ft_launcher's ``main`` with the ranks started as a Python
  callable from a warm fork server, where the release has the torchrun-style API for it (else None).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import re
from typing import Any

MIN_VERSION = (0, 4, 1)

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


def check_supported(*, in_process: bool, in_job: bool) -> None:
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


def wrapper_kwargs(**kw: Any) -> dict[str, Any]:
    from nvidia_resiliency_ext import inprocess

    accepted = set(inspect.signature(inprocess.Wrapper.__init__).parameters)
    missing = [k for k in _REQUIRED_WRAPPER_ARGS if k in kw and k not in accepted]
    if missing:
        raise UnsupportedNvrx(f"inprocess.Wrapper in nvidia-resiliency-ext {version_str()} does not take "
                              f"{', '.join(missing)}; pass --no-in-process")
    return {k: v for k, v in kw.items() if k in accepted}


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
}


def launcher_flag(name: str) -> str | None:
    """This release's spelling of an ft_launcher setting, or None if it has none (skip it)."""
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
