"""The local launcher: runs a job's processes on this machine under NVRx ft_launcher.

Each attempt runs as ``sh -c '<trainer.launch ...>; echo $? > exit-<attempt>'`` in a new session,
detached with ``setsid -f`` so that no control-plane process is its parent: a worker or web restart
neither kills it nor leaves a zombie, and any process can find it again from ``launcher_state``
(pid + create time, so a reused pid is never mistaken for ours). The shell writes the exit status,
so the exit code survives the control plane being down when the job ends.

Stopping sends SIGTERM to the session's process group, then SIGKILL after the grace period, then
sweeps any process that carries the attempt's launch tag in its environment (NVRx's in-process
monitor double-forks outside the tree), so nothing is left behind.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from django.conf import settings

from controlplane.jobs.models import Job
from controlplane.jobs.spec import JobSpec
from controlplane.launchers.base import LaunchError, LaunchFault, PollResult
from controlplane.launchers.command import launch_args, launch_env, nvrx_problems
from controlplane.launchers.isolation import account_problems, job_account, prepare_run_dir, rank_env
from trainer import nvrx_compat
from trainer.ports import free_port_block
from trainer.wire import FaultClass

log = logging.getLogger(__name__)

# trainer.launch's exit status for refused flags, for user code that cannot start, and for a failure-policy
# rule that said stop (trainer/launch.py).
EXIT_BAD_FLAGS, EXIT_CANNOT_START, EXIT_POLICY_STOP = 2, 3, 4

_SHELL = 'echo $$ > "$UNBROKEN_PID_FILE"; "$@"; echo $? > "$UNBROKEN_EXIT_FILE"'


def run_dir(job: Job) -> Path:
    return Path(settings.DATA_DIR) / "jobs" / str(job.pk)


def _free_port_block() -> int:
    """A base port with 4 consecutive free ports (rdzv, app store, wrapper store, ...)."""
    try:
        return free_port_block(4, tries=50)
    except OSError as e:
        raise LaunchError(f"{e}; free some ports and retry") from e


def _interpreter_problems(spec: JobSpec, account) -> list[str]:
    """Why the spec's interpreter cannot run the job's ranks: it must import ``unbroken`` (pip install
    ./trainer) and ``torch``, with the environment the launch gives it, as the job's account."""
    env = {**rank_env(dict(os.environ), spec.env, home=tempfile.gettempdir()),
           "PYTHONPATH": nvrx_compat.child_pythonpath(
               [str(settings.BASE_DIR), str(settings.BASE_DIR / "trainer")],
               spec.env.get("PYTHONPATH") or os.environ.get("PYTHONPATH")),
           "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        r = subprocess.run([spec.python, "-c", "import unbroken, torch"], env=env, capture_output=True,
                           text=True, timeout=120, stdin=subprocess.DEVNULL, cwd=tempfile.gettempdir(),
                           **_as_account(account))
    except (OSError, subprocess.TimeoutExpired) as e:
        return [f"python: {spec.python} cannot run ({e}); name the interpreter of the environment where "
                "you ran pip install ./trainer"]
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return [f"python: {spec.python} cannot import unbroken and torch ({last}); run pip install ./trainer "
                "(and torch) in that environment, or name its interpreter"]
    return []


def launch_tag(job: Job) -> str:
    """The tag in the environment of every process of one attempt (how stop finds escapees). It names this
    control plane's data directory too: another control plane on the machine (a second install, a neighbour's
    test run) has a job with the same number, and its stop must not signal this one's processes."""
    home = hashlib.sha256(str(Path(settings.DATA_DIR).resolve()).encode()).hexdigest()[:8]
    return f"job{job.pk}-a{job.attempt}-{home}"


class LocalLauncher:
    name = "local"

    def preflight(self, job: Job) -> list[str]:
        problems = []
        spec = job.job_spec
        if spec.nodes != 1:
            problems.append("the local backend runs one node; use the kubernetes backend for more")
        cpus = os.cpu_count() or 1
        if spec.procs_per_node > 4 * cpus:
            problems.append(f"{spec.procs_per_node} processes on {cpus} CPU cores would crawl; use at most {4 * cpus}")
        try:
            account = job_account()
        except LaunchError as e:
            return [*problems, str(e)]
        # The job's account must be able to run the job's Python (the spec's, else this one) and our trainer
        # (not under a 0700 /root).
        python = Path(spec.python or sys.executable)
        unreachable = account_problems(account, [*([python] if python.exists() else []),
                                                 Path(settings.BASE_DIR) / "trainer"])
        problems += unreachable
        # The spec's own interpreter first: the entrypoint check below runs in it.
        interpreter = _interpreter_problems(spec, account) if spec.python and not unreachable else []
        problems += interpreter
        if spec.entrypoint:
            problems += [] if unreachable or interpreter else _user_code_problems(spec, account)
        elif spec.preset not in ("tiny", "small"):
            problems.append(f"preset {spec.preset!r} needs GPUs; on this machine use tiny or small")
        # Local ranks run with this process's environment, so its NVRx is theirs.
        installed = ".".join(map(str, nvrx_compat.version()))
        problems += nvrx_problems(spec, installed)
        return problems

    def launch(self, job: Job, *, token: str | None) -> dict:
        problems = self.preflight(job)
        if problems:
            raise LaunchError("; ".join(problems))
        rd = run_dir(job)
        (rd / "logs").mkdir(parents=True, exist_ok=True)
        token_file = rd / "token"
        if token is not None:
            fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(token)
        elif not token_file.exists():
            raise LaunchError("the job's token file is gone; start a new job")
        spec = job.job_spec
        base_port = _free_port_block()
        argv = [spec.python or sys.executable, "-m", "trainer.launch", *launch_args(
            spec, node_rank=0, rdzv_endpoint=f"127.0.0.1:{base_port}", run_dir=str(rd),
            job_id=job.pk, attempt=job.attempt, report_url=settings.PUBLIC_URL,
            working_dir=(spec.working_dir or str(settings.BASE_DIR)) if spec.entrypoint else "",
        )]
        log_path = rd / "logs" / f"attempt-{job.attempt}.log"
        pid_file = rd / f"pid-{job.attempt}"
        exit_file = rd / f"exit-{job.attempt}"
        for f in (pid_file, exit_file):
            f.unlink(missing_ok=True)
        account = job_account()
        prepare_run_dir(rd, account)
        home = rd / "home"
        home.mkdir(exist_ok=True)
        if account is not None:
            os.chown(home, account.uid, account.gid)
        env = {
            # An allowlist of the control plane's environment, never all of it (launchers/isolation.py).
            **rank_env(dict(os.environ), spec.env, home=str(home)),
            # This tree's trainer and SDK (``unbroken`` lives in trainer/), whatever the venv installed.
            "PYTHONPATH": nvrx_compat.child_pythonpath(
                [str(settings.BASE_DIR), str(settings.BASE_DIR / "trainer")],
                spec.env.get("PYTHONPATH") or os.environ.get("PYTHONPATH")),
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "TORCH_CPP_LOG_LEVEL": "ERROR",
            "UNBROKEN_TOKEN_FILE": str(token_file),
            "UNBROKEN_LAUNCH_TAG": launch_tag(job),
            "UNBROKEN_PID_FILE": str(pid_file),
            "UNBROKEN_EXIT_FILE": str(exit_file),
            **launch_env(spec),
        }
        if account is not None:
            env.update(USER=account.name, LOGNAME=account.name)
        as_account = _as_account(account)
        with open(log_path, "ab") as log:
            subprocess.run(
                ["setsid", "-f", "sh", "-c", _SHELL, "unbroken-job", *argv],  # noqa: S607 - the server's PATH
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                cwd=settings.BASE_DIR, check=True, **as_account,
            )
        pid = _wait_for_pid(pid_file)
        try:
            created, ticks = psutil.Process(pid).create_time(), start_ticks(pid)
        except psutil.NoSuchProcess:
            created, ticks = None, None  # ended already; the exit file tells how
        return {"pid": pid, "create_time": created, "start_ticks": ticks, "log": str(log_path),
                "exit_file": str(exit_file), "rdzv_port": base_port, "attempt": job.attempt,
                "tag": launch_tag(job), "argv": argv[1:]}

    def _process(self, job: Job) -> psutil.Process | None:
        return _launcher_process(job.launcher_state or {})[0]

    def poll(self, job: Job) -> PollResult:
        st = job.launcher_state or {}
        if not st:
            return PollResult(state="pending", reason="not launched yet")
        exit_file = Path(st.get("exit_file", ""))
        if exit_file.is_file():
            raw = exit_file.read_text().strip()
            code = int(raw) if raw.lstrip("-").isdigit() else -1
            if code == 0:
                return PollResult(state="succeeded", reason="training finished")
            reason = _exit_reason(code)
            if code in (EXIT_BAD_FLAGS, EXIT_CANNOT_START, EXIT_POLICY_STOP):
                # The same code and flags fail the same way again: no job-level restart.
                return PollResult(state="failed", reason=reason, retryable=False)
            fault = LaunchFault(fault_class=FaultClass.PROCESS_KILLED, message=reason,
                                source_key=f"exit-a{st.get('attempt', 0)}", at=exit_file.stat().st_mtime)
            return PollResult(state="failed", reason=reason, faults=[fault])
        proc, why = _launcher_process(st)
        if proc is not None:
            return PollResult(state="running")
        if exit_file.is_file():  # it wrote its exit status and ended between the two looks: read that
            return self.poll(job)
        log.warning("job %s attempt %s: its launcher (pid %s) is gone: %s", job.pk, st.get("attempt"),
                    st.get("pid"), why)
        reason = "the job's launcher process is gone without an exit status (killed, or the machine rebooted)"
        fault = LaunchFault(fault_class=FaultClass.PROCESS_KILLED, message=reason,
                            source_key=f"lost-a{st.get('attempt', 0)}")
        return PollResult(state="lost", reason=reason, faults=[fault])

    def hold(self, job: Job) -> str:
        """Freeze every process of the attempt (SIGSTOP to its session's group and to the tagged escapees):
        memory, stacks and files stay as the fault left them for py-spy or gdb; ``stop`` ends them."""
        proc = self._process(job)
        n = 0
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGSTOP)
                n += 1
            except ProcessLookupError:
                pass
        tag = (job.launcher_state or {}).get("tag")
        n += _signal_tagged(tag, signal.SIGSTOP) if tag else 0
        if not n:
            return "no process was left to keep"
        return f"processes frozen (SIGSTOP), session {proc.pid if proc else '-'}: attach py-spy or gdb; Stop ends them"

    def stop(self, job: Job, *, grace_s: float) -> None:
        st = job.launcher_state or {}
        proc = self._process(job)
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGCONT)  # a held (frozen) attempt must see the SIGTERM
            except ProcessLookupError:
                pass
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and _group_alive(proc.pid):
                time.sleep(0.1)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        tag = st.get("tag")
        if tag:
            _kill_tagged(tag)

    def log_tail(self, job: Job, *, max_bytes: int = 16384, node_rank: int | None = None) -> str:
        path = (job.launcher_state or {}).get("log")
        if not path or not os.path.exists(path):
            return ""
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
        text = data.decode("utf-8", "replace")
        if size > max_bytes:
            text = text.split("\n", 1)[-1]  # drop the partial first line
        return text


def _user_code_problems(spec, account) -> list[str]:
    """The user's code must be where the spec says, on this machine (checked before a job is stored)."""
    workdir = Path(spec.working_dir or settings.BASE_DIR)
    if not workdir.is_dir():
        return [f"working_dir {workdir} is not a directory on this machine"]
    if spec.entrypoint.endswith(".py"):
        script = workdir / spec.entrypoint
        if not script.is_file():
            return [f"entrypoint {spec.entrypoint} does not exist in {workdir}"]
        return account_problems(account, [workdir, script])
    return account_problems(account, [workdir]) or entrypoint_problems(spec, workdir, account)


# Run in the job's environment, as its account, from its working directory: does the entrypoint import?
# A module is looked up without running it (``python -m`` would run it); a function's module is imported
# and the name must be a Python function of the user's code (not ``os:system``).
_CHECK_ENTRYPOINT = """
import importlib, importlib.util, inspect, os, sys, sysconfig
sys.path.insert(0, os.getcwd())
ep = sys.argv[1]
module, _, fn = ep.partition(":")
std = os.path.realpath(sysconfig.get_paths()["stdlib"])
try:
    found = importlib.util.find_spec(module)
except Exception as e:
    sys.exit(f"entrypoint {ep}: cannot look up {module}: {type(e).__name__}: {e}")
if found is None:
    sys.exit(f"entrypoint {ep}: no module {module} in the working directory or the job's Python path")
origin = os.path.realpath(found.origin or "") if found.has_location else ""
if not origin or (origin.startswith(std + os.sep) and "site-packages" not in origin):
    sys.exit(f"entrypoint {ep}: {module} is not your training code (a built-in or standard-library module)")
if fn:
    try:
        obj = getattr(importlib.import_module(module), fn, None)
    except BaseException as e:
        sys.exit(f"entrypoint {ep}: importing {module} failed: {type(e).__name__}: {e}")
    if not inspect.isfunction(obj):
        sys.exit(f"entrypoint {ep}: {module} has no Python function {fn}")
"""


def entrypoint_problems(spec, workdir: Path, account) -> list[str]:
    """Whether a module or function entrypoint imports where the job will run (a script is checked by
    path): in the ranks' environment, as their account, from their working directory."""
    own = [str(settings.BASE_DIR), str(settings.BASE_DIR / "trainer")]
    env = {**rank_env(dict(os.environ), spec.env, home=str(workdir)),
           "PYTHONPATH": nvrx_compat.child_pythonpath(
               own, spec.env.get("PYTHONPATH") or os.environ.get("PYTHONPATH")),
           "PYTHONDONTWRITEBYTECODE": "1"}
    as_account = _as_account(account)
    try:
        done = subprocess.run([spec.python or sys.executable, "-c", _CHECK_ENTRYPOINT, spec.entrypoint],
                              cwd=workdir, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=60, **as_account)
    except subprocess.TimeoutExpired:
        return [f"entrypoint {spec.entrypoint}: importing it took over 60 s"]
    if done.returncode == 0:
        return []
    lines = (done.stderr or "").strip().splitlines()
    return [lines[-1][:500] if lines else
            f"entrypoint {spec.entrypoint}: the import check exited {done.returncode}"]


def _as_account(account) -> dict:
    """subprocess.run's arguments that start a process as ``account`` (none: as this process)."""
    return {"user": account.uid, "group": account.gid, "extra_groups": []} if account is not None else {}


def _launcher_process(st: dict) -> tuple[psutil.Process | None, str]:
    """The attempt's launcher process (the shell that writes its exit status), or None and why not."""
    pid = st.get("pid")
    if not pid:
        return None, "no pid recorded"
    try:
        proc = psutil.Process(pid)
        ticks = start_ticks(pid)
        if st.get("start_ticks") is not None and ticks is not None:
            if ticks != st["start_ticks"]:
                return None, (f"pid {pid} is another process now (started {ticks} clock ticks after boot, "
                              f"the launcher {st['start_ticks']})")
        elif st.get("create_time") and abs(proc.create_time() - st["create_time"]) > 1.0:
            return None, (f"pid {pid} is another process now (started at {proc.create_time():.2f}, the "
                          f"launcher at {st['create_time']:.2f})")
        status = proc.status()
        if status == psutil.STATUS_ZOMBIE:
            return None, f"pid {pid} is a zombie (ended; parent {proc.ppid()})"
        return proc, status
    except psutil.NoSuchProcess:
        return None, f"no process {pid}"


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat``'s 22nd field), or None off
    Linux. What tells a process from a later one with the same pid: psutil's ``create_time`` adds the boot
    time as wall-clock seconds, which moves when a VM's clock is stepped (a paused or overloaded VM), and a
    live launcher judged gone restarts the whole job."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
        return int(raw[raw.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _wait_for_pid(pid_file: Path, timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            raw = pid_file.read_text().strip()
            if raw:
                return int(raw)
        except FileNotFoundError:
            pass
        time.sleep(0.02)
    raise LaunchError(f"the job's process did not start within {timeout_s:.0f} s; see its log")


def _group_alive(pgid: int) -> bool:
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            continue
    return False


def _kill_tagged(tag: str) -> int:
    """SIGKILL every process whose environment carries this launch tag (escaped daemons)."""
    return _signal_tagged(tag, signal.SIGKILL)


def _signal_tagged(tag: str, sig: signal.Signals) -> int:
    """Send ``sig`` to every process whose environment carries this launch tag."""
    n = 0
    me = os.getpid()
    for p in psutil.process_iter(["pid"]):
        if p.pid == me:
            continue
        try:
            if p.environ().get("UNBROKEN_LAUNCH_TAG") == tag:
                p.send_signal(sig)
                n += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return n


def _exit_reason(code: int) -> str:
    if code == EXIT_CANNOT_START:
        return "the training code failed before training started; its traceback is in the fault table"
    if code == EXIT_POLICY_STOP:
        return "a failure-policy rule stopped the job's in-job restarts (exit 4); see the policy event"
    if code == EXIT_BAD_FLAGS:
        return "the launcher refused the job's settings (exit 2); see the log"
    if code > 128:
        try:
            name = signal.Signals(code - 128).name
        except ValueError:
            name = f"signal {code - 128}"
        return f"the job's launcher was killed by {name} (exit {code})"
    return f"the job's launcher exited with code {code}: ft_launcher ran out of restarts or training failed; see the log"

