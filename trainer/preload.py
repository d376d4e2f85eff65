"""What the warm fork server imports before it forks ranks (``trainer.launch``): the modules every rank
of the job imports anyway, imported once per launcher instead of at every rank start, so the new ranks
of an in-job restart skip them (FSDP2's import and the dynamo import its first ``fully_shard`` makes
were ~1 s of a rank's start here).

- The SDK's training-side modules (FSDP2, DTensor, DCP, the NVRx in-process layer, ours).
- The entrypoint's top-level imports of installed packages (``transformers``, ``numpy``...), read from
  its source without running it (``entrypoint_imports``). The user's own modules (found under the
  working directory or the script's directory) are left to the ranks: importing one runs its code,
  which may need a rank's environment.

The launcher puts the list in ``UNBROKEN_PRELOAD_MODULES``; the fork server imports this module, which
imports each listed module on its own and leaves any failure to the rank (which imports it again and
reports its own traceback): nothing here can stop the fork server. ``UNBROKEN_PRELOAD=0`` turns the
entrypoint's part off (the SDK's part stays: the ranks import it in any case).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
import sysconfig

ENV = "UNBROKEN_PRELOAD_MODULES"

SDK_MODULES = (
    "torch._dynamo",  # FSDP2's first fully_shard calls a dynamo-disabled function, which imports it (~0.6 s)
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "nvidia_resiliency_ext.inprocess",
    "trainer.checkpoint",
    "trainer.resilience",
    "trainer.fullrun",
)


def modules_for(entrypoint: str | None, cwd: str) -> list[str]:
    """What to preload for ``entrypoint`` (run from ``cwd``): the SDK's modules, then the entrypoint's."""
    out = list(SDK_MODULES)
    if entrypoint and os.environ.get("UNBROKEN_PRELOAD", "1") != "0":
        out += [m for m in entrypoint_imports(entrypoint, cwd) if m not in out]
    return out


def entrypoint_imports(entrypoint: str, cwd: str) -> list[str]:
    """The absolute imports at the top level of the entrypoint's source that name installed modules
    (not the user's own: nothing under ``cwd`` or the script's directory), in source order."""
    path = _source_of(entrypoint, cwd)
    if path is None:
        return []
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return []  # the launcher's own check reports a script that does not compile
    own = {os.path.realpath(cwd), os.path.realpath(os.path.dirname(path))}
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    out: list[str] = []
    for name in names:
        if name not in out and _installed(name.split(".")[0], own):
            out.append(name)
    return out


def _source_of(entrypoint: str, cwd: str) -> str | None:
    """The file Python would run for ``entrypoint`` (a script, ``pkg.mod`` or ``pkg.mod:fn``), found by
    path only: finding a submodule through importlib would import (run) its parent packages."""
    if entrypoint.endswith(".py"):
        path = os.path.join(cwd, entrypoint)
        return path if os.path.isfile(path) else None
    module, _, func = entrypoint.partition(":")
    parts = module.split(".")
    for root in (cwd, *sys.path):
        base = os.path.join(root or ".", *parts)
        for cand in (base + ".py", os.path.join(base, "__init__.py" if func else "__main__.py")):
            if os.path.isfile(cand):
                return cand
    return None


def _installed(top: str, own: set[str]) -> bool:
    """``top`` is importable and is not the user's own: the standard library and site-packages are
    installed even inside the user's directory (a virtualenv there); anything else under the user's
    directories is theirs. A top-level lookup runs nothing."""
    if top in sys.builtin_module_names:
        return True
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    if spec.origin in ("built-in", "frozen"):
        return True
    installed = _installed_roots()
    for place in list(spec.submodule_search_locations or []) or [spec.origin or ""]:
        real = os.path.realpath(place)
        if not any(_under(real, d) for d in installed) and any(_under(real, d) for d in own):
            return False
    return True


def _installed_roots() -> list[str]:
    paths = sysconfig.get_paths()
    return [os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(k)]


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root + os.sep)


def warm(names: str) -> list[str]:
    """Import each comma-separated module; return the ones that failed (left to the ranks)."""
    failed = []
    for name in filter(None, (n.strip() for n in names.split(","))):
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - the rank imports it again and reports its own error
            failed.append(name)
    return failed


if os.environ.get(ENV):  # imported by the fork server (multiprocessing's preload list)
    warm(os.environ[ENV])
