"""What a local job's ranks get from the control plane: an environment built from an allowlist, and an
account of their own.

Running an operator's code is the product's purpose; running it with the control plane's privileges is
not. So the ranks' environment is built up from nothing: the names below (what torch, CUDA, NCCL, NVRx,
the SDK and Python need), then the spec's ``env``, then what the launcher sets. Nothing else of the
control plane's environment (its database URL, broker URL, secret key file, mail password) reaches a
rank. And when the control plane runs as root, the job runs as ``settings.JOB_USER`` (default
``nobody``): it owns its run directory and nothing else; the secret key file and the SQLite database
are the control plane's alone (mode 0600, checked before each launch).
"""

from __future__ import annotations

import logging
import os
import pwd
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from django.db import connection

from controlplane.launchers.base import LaunchError

log = logging.getLogger(__name__)

# Names a rank inherits from the control plane's environment when they are set there.
ALLOWED_NAMES = frozenset({
    "PATH", "LANG", "LANGUAGE", "TZ", "TERM", "TMPDIR", "VIRTUAL_ENV", "LD_LIBRARY_PATH",
    "PYTHONHASHSEED", "PYTHONWARNINGS", "PYTHONFAULTHANDLER", "PYTHONDONTWRITEBYTECODE",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE",
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy",
    # The SDK's and launcher's own knobs an operator may set for every job (never a credential).
    "UNBROKEN_PRELOAD", "UNBROKEN_STANDBY_RANKS", "UNBROKEN_CKPT_SAVER", "UNBROKEN_FORK_RANKS",
    "UNBROKEN_REPORTER_JOURNAL_DIR",
})
ALLOWED_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "NCCL_", "TORCH_", "PYTORCH_", "TORCHINDUCTOR_", "TRITON_",
                    "NVRX_", "NVTE_", "CUBLAS_", "CUDNN_", "OMP_", "MKL_", "KMP_", "GLOO_", "FI_", "UCX_")


def rank_env(inherited: dict[str, str], spec_env: dict[str, str], *, home: str) -> dict[str, str]:
    """The allowlisted part of ``inherited`` (the control plane's environment), then ``spec_env``; ``HOME``
    is the job's (its account's home or its run directory), never the control plane's. A name that looks
    like a secret is dropped even when allowlisted (``NCCL_..._TOKEN``)."""
    from controlplane.jobs.spec import SECRET_ENV

    env = {k: v for k, v in inherited.items()
           if (k in ALLOWED_NAMES or k.startswith(ALLOWED_PREFIXES)) and not SECRET_ENV.search(k)}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env["HOME"] = home
    env.update(spec_env)
    return env


@dataclass(frozen=True, slots=True)
class Account:
    name: str
    uid: int
    gid: int


def job_account() -> Account | None:
    """The account local jobs run as when the control plane is root (it can switch); None when jobs run
    as the control plane's own user (it is not root, or UNBROKEN_JOB_USER=root).

    UNBROKEN_JOB_USER unset: ``nobody`` where that account can run this Python and our trainer, else the
    control plane's own user with one warning (a Python under a 0700 /root, pyenv's default as root, is out
    of every other account's reach: isolating jobs there needs a Python elsewhere). Named: that account or
    a refusal that says why."""
    if os.geteuid() != 0:
        return None
    name = settings.JOB_USER or "nobody"
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        if not settings.JOB_USER:
            return _unisolated(f"there is no account {name!r}")
        raise LaunchError(f"UNBROKEN_JOB_USER={name!r} is not an account on this machine: create it "
                          "(useradd --system --no-create-home unbroken-job) or name another") from None
    if pw.pw_uid == 0:
        return None  # UNBROKEN_JOB_USER=root: the operator chose to run jobs with the control plane's rights
    account = Account(name=name, uid=pw.pw_uid, gid=pw.pw_gid)
    if not settings.JOB_USER:
        blocked = account_problems(account, [Path(sys.executable), Path(settings.BASE_DIR) / "trainer"])
        if blocked:
            return _unisolated(blocked[0])
    return account


_warned: set[str] = set()


def _unisolated(why: str) -> None:
    """UNBROKEN_JOB_USER unset and no account to isolate jobs with: they run as root (warned once)."""
    if why not in _warned:
        _warned.add(why)
        log.warning("local jobs run as root with the control plane's rights (%s); set UNBROKEN_JOB_USER to an "
                    "account that can run this Python to isolate them (docs/guides/security.md)", why)
    return None


def account_problems(account: Account | None, paths: list[Path]) -> list[str]:
    """What the job's account cannot read of the user's code (its working directory and script)."""
    if account is None:
        return []
    problems = []
    for p in paths:
        if not _can_reach(p, account):
            shown = p if p.resolve() == p else f"{p} ({p.resolve()})"
            problems.append(f"{shown} is out of reach of the account jobs run as, {account.name} "
                            "(UNBROKEN_JOB_USER): make it and the directories above it readable by that "
                            "account, or name another (UNBROKEN_JOB_USER=root: jobs get the control plane's "
                            "rights; docs/guides/security.md)")
    return problems


def _can_reach(path: Path, account: Account) -> bool:
    """Whether ``account`` (no supplementary groups) may traverse to and read ``path``."""
    path = path.resolve()
    for p in [*reversed(path.parents), path]:
        try:
            st = p.stat()
        except OSError:
            return False
        need = stat.S_IXOTH if p != path or stat.S_ISDIR(st.st_mode) else stat.S_IROTH
        if st.st_uid == account.uid:
            need <<= 6
        elif st.st_gid == account.gid:
            need <<= 3
        if not st.st_mode & need:
            return False
    return True


def prepare_run_dir(run_dir: Path, account: Account | None) -> None:
    """The job's account owns its run directory (logs are written by the control plane's open file; the
    rest, checkpoints, pid and exit files, the token file, by the job). The control plane's own files
    under its data directory are made its own alone."""
    if account is None:
        return
    protect_control_plane_files()
    for p in [run_dir, *run_dir.rglob("*")]:
        if not p.is_symlink():
            os.chown(p, account.uid, account.gid)
    parent = run_dir.parent  # DATA_DIR/jobs: traversable, not listable (job ids are not secrets, logs are)
    while parent != Path(settings.DATA_DIR).parent and parent != parent.parent:
        parent.chmod(parent.stat().st_mode & 0o7700 | 0o711)
        parent = parent.parent


def protect_control_plane_files() -> None:
    """Mode 0600 for the secret key file and the SQLite database (with its WAL and shared-memory files)."""
    key_file = os.environ.get("UNBROKEN_SECRET_KEY_FILE")
    paths = [Path(key_file)] if key_file else []
    db = connection.settings_dict  # under tests, the test database's
    if db["ENGINE"].endswith("sqlite3") and "memory" not in str(db["NAME"]):  # an in-memory one has no file
        name = Path(str(db["NAME"]))
        paths += [name, name.with_name(name.name + "-wal"), name.with_name(name.name + "-shm")]
    for p in paths:
        try:
            if p.is_file() and p.stat().st_mode & 0o077:
                p.chmod(0o600)
        except OSError:
            continue
