"""Chaos benchmark: the control plane's own faults during a drill, against the trainer's own records.

The production shape on this machine: PostgreSQL (``DATABASE_URL``, default database
``unbroken_chaos``, recreated), a Redis server of its own (started here on a free port, no
persistence), and web + Celery worker + beat under ``manage.py serve``. A 2-rank job (the demo's tiny
model through the bench's own entrypoint, tests/bench/steplog_workload.py, which logs every step each
rank completes) with three drills (exception, sigkill, nan_loss) trains while this script, in turn:

1. kills the Celery worker with SIGKILL (``serve`` must restart it);
2. kills its Redis with SIGKILL for 20 s (broker and heartbeat store; it comes back empty);
3. restarts the web server (SIGTERM to the web child; ``serve`` starts it again);
4. stops ingest (SIGSTOP to the web's process group) for longer than the job's step timeout;
5. kills ``serve`` itself with SIGKILL: its children must keep serving (the port, a Celery ping) without
   it; then, as the platform would (systemd's KillMode=control-group), the orphans are killed and
   ``serve`` is started again on the same port.

Before each, the job must be training (the API's status running or recovering), or the run fails. After
the job ends:

- events_sent: distinct event ids in the trainers' journal (``UNBROKEN_REPORTER_JOURNAL_DIR``: every
  event each process handed to its sender); events_stored: those stored for the job;
- server_events: events the control plane wrote itself (source ``policy``, ``watchdog``), counted apart
  by source, never as duplicates;
- duplicates: event ids stored twice, plus stored events no sender journalled that the control plane
  did not write either;
- drills_fired: drills with a stored fault of their class on their rank (all must have fired);
- false_faults: faults the control plane recorded that no journal event reported (heartbeat_lost,
  stalled, ...);
- steps_lost_mismatch: |steps lost as the control plane stored them (its restart cycles) - steps the
  ranks ran twice (from the ranks' own step logs: at each restart, the last step a rank completed
  before it minus the step it resumed at, the largest over ranks)|; the per-restart lists are printed;
- control_plane_up: 1 if at the end a process serves the web port and a Celery worker answers a ping
  (the process table, not the supervisor's own state file).

    python tests/bench/bench_chaos.py [--step-timeout-s 12] [--steps 1200]

Then the figures, and the README row's targets beside them (events_stored = events_sent,
duplicates = 0, false_faults = 0, steps_lost_mismatch = 0, control_plane_up = 1, every drill fired,
the job running at every injection), each met or MISSED; the exit status is 1 when one is missed:
events_sent=<N> events_stored=<M> duplicates=<D> false_faults=<F> steps_lost_mismatch=<S>
control_plane_up=<U> drills_fired=<K>/<3> injected_while_running=<I>/<5> server_events=<by source>
"""

from __future__ import annotations

import argparse
import base64
import collections
import contextlib
import itertools
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "bench"))

from controlplane.healthz import read_supervised  # noqa: E402
from trainer.ports import free_port  # noqa: E402

from prodshape import ensure_database  # noqa: E402
from stats import Target, verdict  # noqa: E402

DEFAULT_DB = "postgres://postgres@127.0.0.1:5432/unbroken_chaos"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def recreate_database(url: str) -> None:
    import psycopg

    name = url.rsplit("/", 1)[1]
    admin = url.rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    ensure_database(url)


def start_redis(port: int, data_dir: Path) -> subprocess.Popen:
    p = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                          "--appendonly", "no", "--dir", str(data_dir)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    for _ in range(50):
        try:
            import redis

            redis.Redis(port=port, socket_connect_timeout=0.2).ping()
            return p
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.1)
    raise SystemExit("redis-server did not start")


class Api:
    def __init__(self, base: str, user: str, password: str):
        self.base = base
        self.auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

    def call(self, method: str, path: str, body: dict | None = None,
             timeout: float = 10.0) -> tuple[int, dict]:
        req = urllib.request.Request(self.base + path, method=method,
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Authorization": self.auth, "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            return e.code, {"error": e.read().decode()[:300]}
        except OSError as e:
            return 0, {"error": str(e)}


def health(base: str) -> dict[str, dict[str, str]] | None:
    try:
        with urllib.request.urlopen(base + "/healthz", timeout=3) as r:
            body = r.read().decode()
    except OSError:
        return None
    return read_supervised(body)


def wait_for(cond, timeout_s: float, what: str):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.5)
    raise SystemExit(f"timed out waiting for {what}")


def journal(journal_dir: Path) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for f in journal_dir.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            if line.strip():
                e = json.loads(line)
                out[e["id"]] = e
    return out


SERVER_SOURCES = ("policy", "watchdog")  # sources of the events the control plane writes itself
DRILL_CLASS = {"exception": "exception", "sigkill": "process_killed", "nan_loss": "nan_loss"}


def ranks_steps_lost(step_dir: Path) -> list[int]:
    """Per restart, in order: the steps ranks ran twice, from each rank's own step log (the largest over
    ranks). A restart shows as a step that does not follow the one before (the rank resumed at a
    checkpoint): the steps from the one it resumed at to the last it completed before were run again."""
    per_rank = []
    for f in sorted(step_dir.glob("rank*.log")):
        steps = [int(line.split()[0]) for line in f.read_text().splitlines() if line.strip()]
        per_rank.append([prev - cur + 1 for prev, cur in itertools.pairwise(steps) if cur != prev + 1])
    return [max(x) for x in itertools.zip_longest(*per_rank, fillvalue=0)]


def compare(db_url: str, job_id: int, events: dict[str, dict], step_dir: Path,
            drills: list[dict]) -> dict[str, object]:
    import psycopg

    with psycopg.connect(db_url) as conn:
        stored = conn.execute("SELECT event_id, source FROM jobs_event WHERE job_id = %s",
                              [job_id]).fetchall()
        faults = conn.execute("SELECT fault_class, rank, source_key, message FROM jobs_fault "
                              "WHERE job_id = %s", [job_id]).fetchall()
        cycles = conn.execute(
            "SELECT key, CASE WHEN resumed_from_step IS NULL THEN NULL ELSE "
            "GREATEST(0, COALESCE(step_at_fault, step_at_fault_estimate) - resumed_from_step) END "
            "FROM jobs_restartcycle WHERE job_id = %s ORDER BY COALESCE(fault_at, detected_at)",
            [job_id]).fetchall()
    sent = set(events)
    ids = [e for e, _ in stored]
    stored_set = set(ids)
    server = collections.Counter(src for e, src in stored if e not in sent and src in SERVER_SOURCES)
    no_sender = sorted((e, src) for e, src in stored if e not in sent and src not in SERVER_SOURCES)
    journal_faults = {f"event:{i}" for i, e in events.items() if e["kind"] == "fault"}
    false = [(c, m[:80]) for c, _, k, m in faults if k not in journal_faults]
    fired = [d for d in drills
             if any(c == DRILL_CLASS[d["fault"]] and r == d["rank"] for c, r, _, _ in faults)]
    stored_lost = [v for _, v in cycles]
    ranks_lost = ranks_steps_lost(step_dir)
    stored_total = sum(v or 0 for v in stored_lost)
    log(f"steps lost by restart cycle, stored: {dict(cycles)} (total {stored_total}); the ranks' own step "
        f"logs, by restart: {ranks_lost} (total {sum(ranks_lost)})")
    if None in stored_lost:
        log("a stored cycle has no steps lost (it never resumed): counted as a mismatch")
    if false:
        log(f"faults no trainer event reported: {false}")
    if no_sender:
        log(f"stored events no sender journalled ({len(no_sender)}): {no_sender[:10]}")
    keys = ["{step}:{fault}:{rank}".format(**d) for d in drills]
    log(f"drills fired: {len(fired)} of {len(drills)} ({', '.join(keys)})")
    missing = sorted(sent - stored_set)
    if missing:
        log(f"events sent but not stored ({len(missing)}): {missing[:10]}")
    return {"events_sent": len(sent), "events_stored": len(sent & stored_set),
            "duplicates": len(no_sender) + (len(ids) - len(stored_set)),
            "false_faults": len(false),
            "steps_lost_mismatch": abs(stored_total - sum(ranks_lost)) + stored_lost.count(None),
            "drills_fired": len(fired), "server_events": dict(server),
            "restarts_stored": len(cycles), "restarts_in_step_logs": len(ranks_lost)}


def serving(port: int) -> list[int]:
    """The pids listening on ``port`` (the process table, not the supervisor's file)."""
    import psutil

    return sorted({c.pid for c in psutil.net_connections(kind="tcp")
                   if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid})


def celery_answers(env: dict[str, str]) -> bool:
    """A Celery worker answers a ping over the broker."""
    try:
        r = subprocess.run([sys.executable, "-m", "celery", "-A", "controlplane", "inspect", "ping",
                            "--timeout", "5"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return False
    return r.returncode == 0 and "pong" in r.stdout


def tree(pid: int) -> list[int]:
    import psutil

    try:
        return [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--step-timeout-s", type=float, default=12.0,
                    help="the job's; more than the in-process layer's hard timeout (the spec requires it)")
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--redis-down-s", type=float, default=20.0)
    ap.add_argument("--job-timeout-s", type=float, default=900.0)
    args = ap.parse_args()
    # `timeout` sends SIGTERM: unwind through the `finally` below, so serve and Redis are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    db_url = os.environ.get("UNBROKEN_CHAOS_DATABASE_URL", DEFAULT_DB)
    tmp = Path(tempfile.mkdtemp(prefix="unbroken-chaos-"))
    journal_dir, step_dir = tmp / "journal", tmp / "steps"
    journal_dir.mkdir()
    step_dir.mkdir()
    redis_port, web_port = free_port(), free_port()
    password = secrets.token_urlsafe(12)
    base = f"http://127.0.0.1:{web_port}"
    env = {**os.environ, "DATABASE_URL": db_url, "REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
           "UNBROKEN_DATA_DIR": str(tmp / "var"), "UNBROKEN_SECRET_KEY": secrets.token_urlsafe(40),
           "UNBROKEN_PUBLIC_URL": base, "UNBROKEN_OPERATOR_PASSWORD": password,
           "UNBROKEN_REPORTER_JOURNAL_DIR": str(journal_dir),
           "PYTHONPATH": f"{ROOT}:{ROOT / 'trainer'}"}
    env.pop("UNBROKEN_SECRET_KEY_FILE", None)
    log(f"data {tmp}; Postgres {db_url}; Redis on port {redis_port}; web on port {web_port}")
    recreate_database(db_url)
    redis_proc = start_redis(redis_port, tmp)
    py = sys.executable
    for cmd in (["migrate", "--noinput", "-v", "0"], ["ensure_operator"]):
        subprocess.run([py, "manage.py", *cmd], cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    serve_log = open(tmp / "serve.log", "w")  # noqa: SIM115 - closed at the end

    def start_serve() -> subprocess.Popen:
        return subprocess.Popen([py, "manage.py", "serve", "--port", str(web_port), "--web-workers", "1"],
                                cwd=ROOT, env=env, stdout=serve_log, stderr=subprocess.STDOUT,
                                start_new_session=True)

    serve = start_serve()
    started = [serve]  # every serve this script started: their process trees are ended at the end
    orphans: list[int] = []
    result: dict[str, object] = {}
    up, running_at = 0, []
    drills = [{"step": args.steps // 5, "fault": "exception", "rank": 1},
              {"step": args.steps // 2, "fault": "sigkill", "rank": 1},
              {"step": args.steps * 4 // 5, "fault": "nan_loss", "rank": 0}]
    try:
        def all_up() -> bool:
            return bool((h := health(base)) and len(h) == 3 and all(c["alive"] == "1" for c in h.values()))

        wait_for(all_up, 90, "serve's three children")
        api = Api(base, "operator", password)
        spec = {"steps": args.steps, "procs_per_node": 2, "checkpoint_interval": 20, "in_process": True,
                "step_timeout_s": args.step_timeout_s, "drills": drills,
                "entrypoint": str(ROOT / "tests" / "bench" / "steplog_workload.py"),
                "args": ["--steps", str(args.steps)], "env": {"BENCH_STEP_LOG_DIR": str(step_dir)}}
        status, body = api.call("POST", "/api/v1/jobs", {"name": "chaos", "spec": spec})
        if status not in (200, 201):
            raise SystemExit(f"could not create the job: {status} {body}")
        job_id = int(body.get("id") or body["job"]["id"])
        log(f"job {job_id} created")

        def job() -> dict:
            s, b = api.call("GET", f"/api/v1/jobs/{job_id}")
            return (b.get("job", b) if s == 200 else {}) or {}

        def injecting(what: str) -> None:
            """Every fault is injected into a training job (running, or mid-restart: recovering), or the run
            fails (a job that finished early shows zeros)."""
            st = wait_for(lambda: job().get("status"), 60, "the job's status")
            running_at.append(st in ("running", "recovering"))
            log(f"{len(running_at)}. {what} (job {st})")

        wait_for(lambda: job().get("status") == "running", 180, "the job to train")
        t0 = time.time()
        log("training; chaos begins")

        def children() -> dict:
            return wait_for(lambda: health(base), 60, "the web to answer")

        time.sleep(5)
        worker = int(children()["worker"]["pid"])
        injecting(f"kill the Celery worker (pid {worker}) with SIGKILL")
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: (h := health(base)) and h["worker"]["alive"] == "1"
                 and h["worker"]["pid"] != str(worker), 60, "the worker to come back")
        log("   the worker is back")
        time.sleep(5)
        injecting(f"kill Redis (pid {redis_proc.pid}) with SIGKILL for {args.redis_down_s:.0f} s")
        redis_proc.kill()
        redis_proc.wait(10)
        time.sleep(args.redis_down_s)
        redis_proc = start_redis(redis_port, tmp)
        log("   Redis is back (empty)")
        time.sleep(5)
        web = int(children()["web"]["pid"])
        injecting(f"restart the web server (SIGTERM to pid {web})")
        os.killpg(web, signal.SIGTERM)
        wait_for(lambda: (h := health(base)) and h["web"]["pid"] != str(web), 60, "the web to come back")
        log("   the web is back")
        time.sleep(5)
        web = int(children()["web"]["pid"])
        stop_s = args.step_timeout_s + 8
        injecting(f"stop ingest (SIGSTOP to the web, pid {web}) for {stop_s:.0f} s (step timeout "
                  f"{args.step_timeout_s:.0f} s)")
        os.killpg(web, signal.SIGSTOP)
        time.sleep(stop_s)
        os.killpg(web, signal.SIGCONT)
        log("   ingest is back")
        time.sleep(5)
        orphans = [pid for pid in tree(serve.pid) if pid != serve.pid]
        injecting(f"kill the supervisor (serve, pid {serve.pid}) with SIGKILL; its children: {orphans}")
        serve.kill()
        serve.wait()
        time.sleep(5)
        alone = bool(serving(web_port)) and celery_answers(env)
        log(f"   without their supervisor the children {'still serve' if alone else 'do NOT serve'} "
            f"(port {web_port}: pids {serving(web_port)}; Celery ping)")
        for pid in orphans:  # the platform's restart (systemd's KillMode=control-group): the orphans go
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        serve = start_serve()
        started.append(serve)
        wait_for(all_up, 90, "the new serve's three children")
        log(f"   serve is back (pid {serve.pid}); chaos took {time.time() - t0:.0f} s")
        final = wait_for(lambda: (j := job()).get("status") in ("succeeded", "failed", "stopped") and j,
                         args.job_timeout_s, "the job to finish")
        log(f"job {job_id} {final.get('status')}: {final.get('status_reason', '')}")
        time.sleep(3)  # the trainers' last batches
        pids = serving(web_port)
        ping = celery_answers(env)
        up = int(alone and bool(pids) and ping)
        log(f"at the end: pids serving port {web_port}: {pids}; a Celery worker answers a ping: {ping}")
        result = compare(db_url, job_id, journal(journal_dir), step_dir, drills)
    finally:
        for proc in started:
            for pid in [] if proc.poll() is not None else tree(proc.pid)[1:]:
                orphans.append(pid)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
        for pid in orphans:  # the children of a killed serve, if still there
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        redis_proc.kill()
        serve_log.close()
        text = (tmp / "serve.log").read_text(errors="replace")
        log(f"serve log: {len(text.splitlines())} lines, {text.count('Traceback')} tracebacks, "
            f"{text.count(' ERROR ')} ERROR lines, {text.count(' WARNING ')} WARNING lines "
            f"({tmp / 'serve.log'})")
        for line in text.splitlines():  # a job-level restart of a live attempt shows as a false fault: why
            if "its launcher (pid" in line:
                log(f"   {line.strip()}")
    figures = {k: result.get(k, -1) for k in ("events_sent", "events_stored", "duplicates", "false_faults",
                                              "steps_lost_mismatch")}
    figures.update(control_plane_up=up, drills_fired=result.get("drills_fired", 0),
                   injected_while_running=sum(running_at))
    shown = [k for k in figures if k not in ("drills_fired", "injected_while_running")]
    print(" ".join(f"{k}={figures[k]}" for k in shown)
          + f" drills_fired={figures['drills_fired']}/{len(drills)}"
          f" injected_while_running={figures['injected_while_running']}/{len(running_at)}"
          f" server_events={result.get('server_events', {})} restarts_stored={result.get('restarts_stored')}"
          f" restarts_in_step_logs={result.get('restarts_in_step_logs')}", flush=True)
    figures["events_missing"] = figures["events_sent"] - figures["events_stored"] if result else -1
    return verdict(figures, [Target("events_missing", "==", 0), Target("duplicates", "==", 0),
                             Target("false_faults", "==", 0), Target("steps_lost_mismatch", "==", 0),
                             Target("control_plane_up", "==", 1), Target("drills_fired", "==", len(drills)),
                             Target("injected_while_running", "==", 5)])


if __name__ == "__main__":
    sys.exit(main())
