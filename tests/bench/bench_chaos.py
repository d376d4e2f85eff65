"""Chaos benchmark: the control plane's own faults during a drill, against the trainer's own journal.

The production shape on this machine: PostgreSQL (``DATABASE_URL``, default database
``unbroken_chaos``, recreated), a Redis server of its own (started here on a free port, no
persistence), and web + Celery worker + beat under ``manage.py serve``. A 2-rank demo job with three
drills (exception, sigkill, nan_loss) trains while this script, in turn:

1. kills the Celery worker with SIGKILL (``serve`` must restart it);
2. stops its Redis for 20 s (broker and heartbeat store; it comes back empty);
3. restarts the web server (SIGTERM to the web child; ``serve`` starts it again);
4. stops ingest (SIGSTOP to the web's process group) for longer than the job's step timeout.

The trainers journal every event they hand to their sender (``UNBROKEN_REPORTER_JOURNAL_DIR``);
after the job ends, the journal is compared with what the control plane stored:

- events_sent: distinct event ids in the journal; events_stored: those stored for the job;
- duplicates: stored events not in the journal, plus ids stored more than once;
- false_faults: faults the control plane recorded that no journal event reported (heartbeat_lost,
  stalled, ...);
- steps_lost_mismatch: restart cycles whose stored steps lost differ from the journal's (the step
  at the fault minus the checkpoint step loaded), or that are missing;
- control_plane_up: 1 if ``serve`` still runs with every child alive at the end.

    python tests/bench/bench_chaos.py [--step-timeout-s 10] [--steps 700]

Last line: events_sent=<N> events_stored=<M> duplicates=<D> false_faults=<F> steps_lost_mismatch=<S>
control_plane_up=<U>
"""

from __future__ import annotations

import argparse
import base64
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

from prodshape import ensure_database  # noqa: E402
from trainer.ports import free_port  # noqa: E402

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
            lines = r.read().decode().splitlines()
    except OSError:
        return None
    out = {}
    for line in lines[1:]:
        name, *kv = line.split()
        out[name] = dict(x.split("=", 1) for x in kv)
    return out


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


def journal_steps_lost(events: dict[str, dict]) -> dict[str, int]:
    """Per cycle: the step at the fault (fault mark or fault event) minus the checkpoint step loaded."""
    at_fault: dict[str, int] = {}
    loaded: dict[str, int] = {}
    for e in sorted(events.values(), key=lambda e: e["at"]):
        d = e.get("data") or {}
        key = d.get("cycle")
        if not key or d.get("step") is None:
            continue
        if e["kind"] == "fault" or (e["kind"] == "cycle" and d.get("mark") == "fault_at"):
            at_fault.setdefault(key, d["step"])
        elif e["kind"] == "cycle" and d.get("mark") == "checkpoint_loaded_at":
            loaded[key] = d["step"]
    return {k: max(0, at_fault[k] - loaded[k]) for k in at_fault if k in loaded}


def compare(db_url: str, job_id: int, events: dict[str, dict]) -> dict[str, int]:
    import psycopg

    with psycopg.connect(db_url) as conn:
        stored = [r[0] for r in conn.execute("SELECT event_id FROM jobs_event WHERE job_id = %s", [job_id])]
        faults = conn.execute("SELECT fault_class, source_key, message FROM jobs_fault WHERE job_id = %s",
                              [job_id]).fetchall()
        cycles = dict(conn.execute(
            "SELECT key, CASE WHEN resumed_from_step IS NULL THEN NULL ELSE "
            "GREATEST(0, COALESCE(step_at_fault, step_at_fault_estimate) - resumed_from_step) END "
            "FROM jobs_restartcycle WHERE job_id = %s", [job_id]).fetchall())
    sent = set(events)
    stored_set = set(stored)
    journal_faults = {f"event:{i}" for i, e in events.items() if e["kind"] == "fault"}
    false = [(c, m[:80]) for c, k, m in faults if k not in journal_faults]
    expected = journal_steps_lost(events)
    mismatch = {k: (v, cycles.get(k)) for k, v in expected.items() if cycles.get(k) != v}
    log(f"journal steps lost by cycle: {expected}; stored: {cycles}")
    if false:
        log(f"faults no trainer event reported: {false}")
    if mismatch:
        log(f"steps lost mismatches (journal, stored): {mismatch}")
    missing = sorted(sent - stored_set)
    if missing:
        log(f"events sent but not stored ({len(missing)}): {missing[:10]}")
    return {"events_sent": len(sent), "events_stored": len(sent & stored_set),
            "duplicates": len(stored_set - sent) + (len(stored) - len(stored_set)),
            "false_faults": len(false), "steps_lost_mismatch": len(mismatch)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--step-timeout-s", type=float, default=10.0)
    ap.add_argument("--steps", type=int, default=700)
    ap.add_argument("--redis-down-s", type=float, default=20.0)
    ap.add_argument("--job-timeout-s", type=float, default=900.0)
    args = ap.parse_args()

    db_url = os.environ.get("UNBROKEN_CHAOS_DATABASE_URL", DEFAULT_DB)
    tmp = Path(tempfile.mkdtemp(prefix="unbroken-chaos-"))
    journal_dir = tmp / "journal"
    journal_dir.mkdir()
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
    serve = subprocess.Popen([py, "manage.py", "serve", "--port", str(web_port), "--web-workers", "1"],
                             cwd=ROOT, env=env, stdout=serve_log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    result: dict[str, int] = {}
    up = 0
    try:
        wait_for(lambda: (h := health(base)) and len(h) == 3 and all(c["alive"] == "1" for c in h.values()),
                 90, "serve's three children")
        api = Api(base, "operator", password)
        spec = {"preset": "tiny", "steps": args.steps, "procs_per_node": 2, "checkpoint_interval": 20,
                "step_timeout_s": args.step_timeout_s,
                "drills": [{"step": args.steps // 5, "fault": "exception", "rank": 1},
                           {"step": args.steps // 2, "fault": "sigkill", "rank": 1},
                           {"step": args.steps * 4 // 5, "fault": "nan_loss", "rank": 0}]}
        status, body = api.call("POST", "/api/v1/jobs", {"name": "chaos", "spec": spec})
        if status not in (200, 201):
            raise SystemExit(f"could not create the job: {status} {body}")
        job_id = int(body.get("id") or body["job"]["id"])
        log(f"job {job_id} created")

        def job() -> dict:
            s, b = api.call("GET", f"/api/v1/jobs/{job_id}")
            return (b.get("job", b) if s == 200 else {}) or {}

        wait_for(lambda: job().get("status") == "running", 180, "the job to train")
        t0 = time.time()
        log("training; chaos begins")

        def children() -> dict:
            return wait_for(lambda: health(base), 60, "the web to answer")

        time.sleep(5)
        worker = int(children()["worker"]["pid"])
        os.kill(worker, signal.SIGKILL)
        log(f"1. killed the Celery worker (pid {worker}) with SIGKILL")
        wait_for(lambda: (h := health(base)) and h["worker"]["alive"] == "1"
                 and h["worker"]["pid"] != str(worker), 60, "the worker to come back")
        log("   the worker is back")
        time.sleep(5)
        redis_proc.terminate()
        redis_proc.wait(10)
        log(f"2. stopped Redis for {args.redis_down_s:.0f} s")
        time.sleep(args.redis_down_s)
        redis_proc = start_redis(redis_port, tmp)
        log("   Redis is back (empty)")
        time.sleep(5)
        web = int(children()["web"]["pid"])
        os.killpg(web, signal.SIGTERM)
        log(f"3. restarted the web server (SIGTERM to pid {web})")
        wait_for(lambda: (h := health(base)) and h["web"]["pid"] != str(web), 60, "the web to come back")
        log("   the web is back")
        time.sleep(5)
        web = int(children()["web"]["pid"])
        stop_s = args.step_timeout_s + 8
        os.killpg(web, signal.SIGSTOP)
        log(f"4. stopped ingest (SIGSTOP to the web, pid {web}) for {stop_s:.0f} s (step timeout "
            f"{args.step_timeout_s:.0f} s)")
        time.sleep(stop_s)
        os.killpg(web, signal.SIGCONT)
        log(f"   ingest is back; chaos took {time.time() - t0:.0f} s")
        final = wait_for(lambda: (j := job()).get("status") in ("succeeded", "failed", "stopped") and j,
                         args.job_timeout_s, "the job to finish")
        log(f"job {job_id} {final.get('status')}: {final.get('status_reason', '')}")
        time.sleep(3)  # the trainers' last batches
        h = health(base)
        up = int(serve.poll() is None and bool(h) and len(h) == 3
                 and all(c["alive"] == "1" for c in h.values()))
        log(f"supervisor children at the end: {h}")
        result = compare(db_url, job_id, journal(journal_dir))
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            try:
                serve.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(serve.pid, signal.SIGKILL)
        redis_proc.terminate()
        serve_log.close()
        text = (tmp / "serve.log").read_text(errors="replace")
        log(f"serve log: {len(text.splitlines())} lines, {text.count('Traceback')} tracebacks, "
            f"{text.count(' ERROR ')} ERROR lines, {text.count(' WARNING ')} WARNING lines "
            f"({tmp / 'serve.log'})")
    print(" ".join(f"{k}={result.get(k, -1)}" for k in
                   ("events_sent", "events_stored", "duplicates", "false_faults", "steps_lost_mismatch"))
          + f" control_plane_up={up}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
