"""``python -m trainer.shim <trainer flags> -- <entrypoint> [args ...]``: one rank of a user's own code.

``trainer.launch --entrypoint`` starts it per rank under ft_launcher. The entrypoint runs as Python
would run it, in this process:

- ``path/to/train.py``: as ``python path/to/train.py args`` (``__main__``, the script's directory first
  on ``sys.path``);
- ``pkg.train``: as ``python -m pkg.train args``;
- ``pkg.train:main``: ``main()`` of that module, with ``sys.argv`` set to ``[pkg.train, *args]``.

Around it (``trainer.usercode``): heartbeats, progress from output lines, per-rank logs, fault facts for
the launcher, the torchelastic error file, and the ``unbroken`` SDK's runtime when the code calls
``unbroken.init()``. Exit status: the code's own (0 on success, 1 on an exception, n for
``sys.exit(n)``), 2 when the flags are wrong.
"""

from __future__ import annotations

import importlib
import logging
import os
import runpy
import sys
import traceback
import warnings

from trainer.config import parse_config
from trainer.orphan import end_with_parent
from trainer.runtime import RankEnv
from trainer.usercode import UserRun, set_current, tee_output

log = logging.getLogger("trainer.shim")


class _CannotStart(Exception):
    """The entrypoint's module does not import: the code cannot start, whatever is retried."""


def split_argv(argv: list[str]) -> tuple[list[str], str, list[str]]:
    if "--" not in argv:
        raise ValueError("expected <trainer flags> -- <entrypoint> [args ...]")
    i = argv.index("--")
    if i + 1 >= len(argv):
        raise ValueError("no entrypoint after '--'")
    return argv[:i], argv[i + 1], argv[i + 2:]


def run_entrypoint(entrypoint: str, args: list[str]) -> None:
    """Run the user's code as Python would (see the module docstring)."""
    if entrypoint.endswith(".py"):
        path = os.path.abspath(entrypoint)
        sys.argv = [path, *args]
        sys.path.insert(0, os.path.dirname(path))
        runpy.run_path(path, run_name="__main__")
        return
    sys.path.insert(0, os.getcwd())
    module, _, func = entrypoint.partition(":")
    if not func:
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    sys.argv = [module, *args]
    try:
        mod = importlib.import_module(module)
    except BaseException as e:
        raise _CannotStart(f"cannot import {module}: {e!r}") from e
    fn = getattr(mod, func, None)
    if not callable(fn):
        raise _CannotStart(f"{module} has no function {func}")
    rv = fn()
    if isinstance(rv, int) and not isinstance(rv, bool) and rv != 0:
        raise SystemExit(rv)


def _record_error_file(exc: BaseException) -> None:
    """torchelastic's per-rank error file (TORCHELASTIC_ERROR_FILE), as ``@record`` writes it."""
    try:
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler

        get_error_handler().record_exception(exc)
    except Exception:  # noqa: BLE001 - the error file is extra; the exit code and our report remain
        pass


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message=".*pynvml.*")
    end_with_parent()  # a SIGKILLed launcher takes its ranks with it
    env = RankEnv.from_env()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s r{env.initial_rank} %(levelname)s %(name)s: %(message)s")
    try:
        flags, entrypoint, args = split_argv(list(sys.argv[1:] if argv is None else argv))
        cfg = parse_config(flags)
    except ValueError as e:
        print(f"trainer.shim: error: {e}", file=sys.stderr)
        return 2
    os.makedirs(cfg.run_dir, exist_ok=True)
    run = UserRun(cfg=cfg, env=env, entrypoint=entrypoint)
    set_current(run)
    tee_output(run, os.path.join(cfg.run_dir, "logs", f"rank{env.initial_rank}.log"))
    run.start()
    try:
        run_entrypoint(entrypoint, args)
    except SystemExit as e:
        if e.code in (None, 0):
            run.finish()
            return 0
        run.fail(e)
        return e.code if isinstance(e.code, int) else 1
    except BaseException as e:  # noqa: BLE001 - everything that ends user code is a fact to report
        cause = e.__cause__ if isinstance(e, _CannotStart) and e.__cause__ is not None else e
        run.fail(cause, cannot_start=isinstance(e, _CannotStart))
        _record_error_file(cause)
        traceback.print_exception(cause)
        return 1
    finally:
        set_current(None)
    run.finish()
    return 0


def entry(*argv: str) -> None:
    """One rank as a Python callable (``trainer.launch`` forks ranks from a warm fork server)."""
    rc = main(list(argv))
    sys.stdout.flush()
    sys.stderr.flush()
    if rc:
        sys.exit(rc)


if __name__ == "__main__":
    sys.exit(main())
