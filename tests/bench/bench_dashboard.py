"""Dashboard benchmark (``make bench-dashboard``): job page server time, ingest -> open page latency.

Builds, in a database of its own (``DATABASE_URL`` if set, else SQLite under var/bench-dashboard/), one
running job on 8 nodes × 8 ranks with 100,000 events, 2,000 checkpoints, 100 restart cycles and 150
faults, then measures:

1. ``job_page_ms``: the job page rendered in-process (Django test client, a signed-in viewer): the
   median of ``--requests`` requests after one warm-up; every part of the page is rendered.
2. ``live_p95_s``: a real server (``uvicorn controlplane.asgi:application``) runs while 64 ranks beat
   once a second through the real ingest API. A client does what an open job page does: poll
   ``/jobs/<id>/live/`` every 500 ms with its cursor and fetch the parts it names. Fault events are
   posted through the ingest API at random intervals; latency is from the moment ingest accepted the
   event (its 200 response) to the moment the client received the fault table showing it.

3. ``fleet``: a second running job of ``--fleet-nodes`` nodes x 8 ranks (12,500 x 8 = 100,000 Rank rows by
   default; 0 skips it) with a lost node, stalled ranks, stragglers, ranks that never beat, faults and
   restart cycles: the median of ``--requests`` loads of its job page, and of its live parts (the
   timeline, the rank-health part and the live cursor), printed on the line before the last as
   ``fleet ranks=<N> job_page_ms=<J> timeline_ms=<T> ranks_ms=<R> live_ms=<L> page_bytes=<B>``.

Then ``job_page_ms=<X> live_p95_s=<Y> fleet_job_page_ms=<F> n_page=<N> n_live=<M>`` (medians and
percentiles by nearest rank, tests/bench/stats.py), and the README row's targets beside them, each met
or MISSED (exit status 1 when one is): job page <= 150 ms, live p95 <= 1 s, the fleet job's page
(issue 9) <= 200 ms server time.
"""

from __future__ import annotations

import argparse
import http.cookiejar
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench.stats import Target, median, percentile, verdict  # noqa: E402

DATA_DIR = ROOT / "var" / "bench-dashboard"
POLL_S = 0.5
RANKS = 64

from trainer.ports import free_port  # noqa: E402  (after the path set-up)


def setup_django() -> None:
    os.environ.setdefault("UNBROKEN_SECRET_KEY", "bench-only-secret-key-not-for-production-0123456789abcdef")
    os.environ["UNBROKEN_DATA_DIR"] = str(DATA_DIR)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    if not os.environ.get("DATABASE_URL"):
        shutil.rmtree(DATA_DIR, ignore_errors=True)
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0, interactive=False)


def build_job(*, num_events: int, num_checkpoints: int, num_cycles: int, num_faults: int):
    """One running 64-rank job with a long history; returns (job, token)."""
    from django.contrib.auth.models import User
    from django.utils import timezone

    from controlplane.jobs.models import (
        AuditEntry,
        Checkpoint,
        Command,
        Event,
        Fault,
        Job,
        Rank,
        RestartCycle,
    )
    from controlplane.jobs.spec import JobSpec, KubernetesSpec

    rnd = random.Random(7)
    now = timezone.now()
    interval_s = 60.0
    age = timedelta(seconds=num_checkpoints * interval_s + 120)
    spec = JobSpec(
        backend="kubernetes",
        nodes=8,
        procs_per_node=8,
        preset="1b",
        steps=10**6,
        checkpoint_interval=100,
        kubernetes=KubernetesSpec(),
    )
    user = User.objects.create_user("bench", password="bench-password-123")
    start = now - age
    job = Job(
        name="bench",
        spec=spec.to_dict(),
        backend="kubernetes",
        status="running",
        created_by=user,
        created_at=start,
        started_at=start,
        first_step_at=start + timedelta(seconds=60),
        last_step=num_checkpoints * 100,
        max_step=num_checkpoints * 100,
        last_progress_at=now,
    )
    token = job.issue_token()
    job.save()
    Rank.objects.bulk_create(
        [
            Rank(
                job=job,
                rank=r,
                node=f"node-{r // 8}",
                phase="train",
                last_heartbeat_at=now,
                last_step=job.last_step,
                step_changed_at=now,
                loss=2.0 + rnd.random(),
                step_time_s=0.5,
                tokens_per_s=40000.0,
                stale_at=now + timedelta(seconds=30),
                stall_at=now + timedelta(seconds=120),
            )
            for r in range(RANKS)
        ]
    )
    first = job.first_step_at
    Checkpoint.objects.bulk_create(
        [
            Checkpoint(
                job=job,
                step=100 * (i + 1),
                mode="async" if i % 10 else "sync",
                state="durable" if i % 97 else "failed",
                started_at=first + timedelta(seconds=interval_s * i + 30),
                blocking_s=0.05 + rnd.random() / 10,
                finished_at=first + timedelta(seconds=interval_s * i + 30 + 2 + 4 * rnd.random()),
                write_s=2.0,
                bytes=2 * 10**9,
            )
            for i in range(num_checkpoints)
        ],
        batch_size=1000,
    )
    layers = ["in_process", "in_process", "in_job", "job"]
    cycles = []
    for i in range(num_cycles):
        f = first + timedelta(seconds=(i + 0.5) * (age.total_seconds() - 200) / num_cycles)
        cycles.append(
            RestartCycle(
                job=job,
                key=f"c{i}",
                layer=layers[i % 4],
                reason="bench",
                fault_at=f,
                detected_at=f + timedelta(seconds=0.3),
                aborted_at=f + timedelta(seconds=0.5),
                restarted_at=f + timedelta(seconds=1),
                checkpoint_loaded_at=f + timedelta(seconds=3),
                first_step_at=f + timedelta(seconds=4),
                step_at_fault=1000 * i + 50,
                resumed_from_step=1000 * i,
            )
        )
    RestartCycle.objects.bulk_create(cycles)
    cycles = list(RestartCycle.objects.filter(job=job).order_by("fault_at"))
    classes = ["exception", "hang", "process_killed", "nan_loss", "heartbeat_lost"]
    Fault.objects.bulk_create(
        [
            Fault(
                job=job,
                cycle=cycles[i % num_cycles],
                fault_class=classes[i % 5],
                rank=i % RANKS,
                node=f"node-{(i % RANKS) // 8}",
                detected_by="trainer",
                message=f"bench fault {i}",
                at=cycles[i % num_cycles].fault_at,
                detected_at=cycles[i % num_cycles].detected_at,
                source_key=f"bench-{i}",
            )
            for i in range(num_faults)
        ]
    )
    for _ in range(50):
        cmd = Command.objects.create(
            job=job, kind="restart", level="in_process", issued_by=user, status="acked"
        )
        AuditEntry.objects.create(
            actor=user, actor_name="bench", action="job.restart", job=job, detail={"command": cmd.pk}
        )
    kinds = ["checkpoint", "cycle", "fault", "rank_started", "command_ack"]
    span = age.total_seconds()
    batch = []
    for i in range(num_events):
        batch.append(
            Event(
                job=job,
                event_id=f"e{i}",
                kind=kinds[i % 5],
                rank=i % RANKS,
                at=start + timedelta(seconds=span * i / num_events),
                received_at=now,
                source=f"rank:{i % RANKS}",
                data={"step": i, "n": i},
            )
        )
        if len(batch) == 5000:
            Event.objects.bulk_create(batch)
            batch = []
    Event.objects.bulk_create(batch)
    return job, token, user


def build_fleet_job(user, *, nodes: int, per_node: int = 8):
    """One running job of ``nodes`` x ``per_node`` ranks, most beating, with what a large job has at any
    time: a lost node, stalled ranks, stragglers, ranks that never beat, faults and restart cycles."""
    from django.utils import timezone

    from controlplane.jobs.models import Checkpoint, Event, Fault, Job, Rank, RestartCycle
    from controlplane.jobs.spec import JobSpec, KubernetesSpec

    rnd = random.Random(9)
    now = timezone.now()
    start = now - timedelta(hours=6)
    spec = JobSpec(backend="kubernetes", nodes=nodes, procs_per_node=per_node, preset="1b", steps=10**6,
                   checkpoint_interval=100, kubernetes=KubernetesSpec())
    job = Job(name="fleet", spec=spec.to_dict(), backend="kubernetes", status="running", created_by=user,
              created_at=start, started_at=start, first_step_at=start + timedelta(seconds=120),
              last_step=20_000, max_step=20_000, last_progress_at=now)
    job.issue_token()
    job.save()
    world = nodes * per_node
    lost_node = nodes // 3
    stalled = {rnd.randrange(world) for _ in range(5)}
    slow = {rnd.randrange(world) for _ in range(5)}
    silent = {rnd.randrange(world) for _ in range(20)}

    def row(r: int) -> Rank:
        if r in silent:
            return Rank(job=job, rank=r, node="", phase="init")
        age = rnd.uniform(0.0, 2.0)
        fields = {}
        if r // per_node == lost_node:
            age = 75.0 + r % per_node
            fields["lost_at"] = now - timedelta(seconds=40)
        if r in stalled:
            fields.update(stalled_at=now - timedelta(seconds=20), step_changed_at=now - timedelta(seconds=150))
        if r in slow:
            fields["straggler_at"] = now - timedelta(seconds=30)
        hb = now - timedelta(seconds=age)
        fields.setdefault("step_changed_at", hb)
        # Deadlines as if the beats kept coming while the page is measured (minutes, not the 30 s timeout):
        # only the lost node and the stalled ranks are past theirs, however long the measurement takes.
        fields.setdefault("stale_at", now + timedelta(minutes=15) if "lost_at" not in fields else hb + timedelta(seconds=30))
        fields.setdefault("stall_at", now + timedelta(minutes=30) if r not in stalled else now - timedelta(seconds=30))
        return Rank(job=job, rank=r, node=f"node-{r // per_node:05d}", phase="train", last_heartbeat_at=hb,
                    last_step=job.last_step, loss=2.0, step_time_s=0.5, tokens_per_s=40000.0,
                    busy_s=0.4 * (1.5 if r in slow else 1.0) + rnd.random() / 100,
                    **fields)

    for i in range(0, world, 10_000):
        Rank.objects.bulk_create([row(r) for r in range(i, min(world, i + 10_000))], batch_size=5000)
    first = job.first_step_at
    Checkpoint.objects.bulk_create([
        Checkpoint(job=job, step=100 * (i + 1), mode="async", state="durable",
                   started_at=first + timedelta(seconds=60 * i + 30), blocking_s=0.1,
                   finished_at=first + timedelta(seconds=60 * i + 34), write_s=3.0, bytes=2 * 10**12)
        for i in range(300)
    ])
    RestartCycle.objects.bulk_create([
        RestartCycle(job=job, key=f"c{i}", layer=["in_process", "in_job", "job"][i % 3], reason="bench",
                     fault_at=(f := first + timedelta(minutes=15 * i + 7)), detected_at=f + timedelta(seconds=0.5),
                     aborted_at=f + timedelta(seconds=1), restarted_at=f + timedelta(seconds=3),
                     checkpoint_loaded_at=f + timedelta(seconds=20), first_step_at=f + timedelta(seconds=30),
                     step_at_fault=800 * i + 50, resumed_from_step=800 * i)
        for i in range(20)
    ])
    cycles = list(RestartCycle.objects.filter(job=job).order_by("fault_at"))
    classes = ["exception", "hang", "process_killed", "nan_loss", "heartbeat_lost"]
    Fault.objects.bulk_create([
        Fault(job=job, cycle=cycles[i % 20], fault_class=classes[i % 5], rank=(r := rnd.randrange(world)),
              node=f"node-{r // per_node:05d}", detected_by="trainer", message=f"fleet fault {i}",
              at=cycles[i % 20].fault_at, detected_at=cycles[i % 20].detected_at, source_key=f"fleet-{i}")
        for i in range(60)
    ] + [
        Fault(job=job, fault_class="heartbeat_lost", rank=lost_node * per_node + k, node=f"node-{lost_node:05d}",
              detected_by="watchdog", message="no heartbeat", at=now - timedelta(seconds=75 + k),
              detected_at=now - timedelta(seconds=40), source_key=f"fleet-lost-{k}")
        for k in range(per_node)
    ])
    Event.objects.bulk_create([
        Event(job=job, event_id=f"s{r}", kind="straggler", rank=r, at=now - timedelta(seconds=30),
              source="watchdog", data={"state": "marked", "slowdown_pct": 50.0})
        for r in slow
    ])
    return job


def measure_fleet(job, user, *, requests: int) -> dict:
    """Medians of the fleet job's page, its live parts and its cursor poll (in-process, signed in)."""
    from django.test import Client

    c = Client(HTTP_HOST="127.0.0.1")
    c.force_login(user)
    urls = {
        "job_page_ms": f"/jobs/{job.pk}/",
        "timeline_ms": f"/jobs/{job.pk}/part/timeline/",
        "ranks_ms": f"/jobs/{job.pk}/part/ranks/",
        "live_ms": f"/jobs/{job.pk}/live/?c=",
    }
    out, size = {}, 0
    for key, url in urls.items():
        times = []
        for i in range(requests + 1):
            t = time.perf_counter()
            resp = c.get(url)
            assert resp.status_code == 200, (url, resp.status_code)
            if i:
                times.append((time.perf_counter() - t) * 1000)
        out[key] = median(times)
        if key == "job_page_ms":
            size = len(resp.content)
        print(f"fleet {key}: " + " ".join(f"{x:.0f}" for x in times))
    out["page_bytes"] = size
    return out


def measure_page(job, user, *, requests: int) -> tuple[float, list[float]]:
    from django.test import Client

    c = Client(HTTP_HOST="127.0.0.1")
    c.force_login(user)
    url = f"/jobs/{job.pk}/"
    times, cpu = [], []
    for i in range(requests + 1):
        t, p = time.perf_counter(), time.process_time()
        resp = c.get(url)
        dt, dp = (time.perf_counter() - t) * 1000, (time.process_time() - p) * 1000
        assert resp.status_code == 200, resp.status_code
        if i:  # the first request warms caches (templates, plotly, imports)
            times.append(dt)
            cpu.append(dp)
    print(
        f"job page: {len(resp.content)} bytes; cpu ms median {median(cpu):.0f}; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    return median(times), times


def wait_up(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"the server at {url} did not come up in {timeout_s:.0f} s")


class PageClient:
    """What an open job page does: poll the cursor, fetch the parts it names (in parallel)."""

    def __init__(self, base: str, job_id: int, sessionid: str):
        self.base, self.job_id = base, job_id
        jar = http.cookiejar.CookieJar()
        jar.set_cookie(
            http.cookiejar.Cookie(
                0,
                "sessionid",
                sessionid,
                None,
                False,
                "127.0.0.1",
                False,
                False,
                "/",
                True,
                False,
                None,
                False,
                None,
                None,
                {},
            )
        )
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
        self.cursor = ""
        self.seen: dict[str, float] = {}
        self.stop = threading.Event()
        self.pool = ThreadPoolExecutor(4)
        self.polls = 0
        self.bytes_unchanged = 0

    def get(self, path: str) -> bytes:
        with self.opener.open(self.base + path, timeout=10) as r:
            return r.read()

    def part(self, name: str) -> tuple[str, bytes]:
        return name, self.get(f"/jobs/{self.job_id}/part/{name}/")

    def run(self, watch: list[str]) -> None:
        while not self.stop.is_set():
            body = self.get(f"/jobs/{self.job_id}/live/?c={self.cursor}")
            j = json.loads(body)
            self.polls += 1
            if not j["changed"]:
                self.bytes_unchanged = len(body)
            for name, html in self.pool.map(self.part, j["changed"]):
                if name == "faults":
                    text = html.decode()
                    t = time.monotonic()
                    for marker in watch:
                        if marker in text and marker not in self.seen:
                            self.seen[marker] = t
            self.cursor = j["cursor"]
            self.stop.wait(POLL_S)


def live_fault_message(i: int, marker: str) -> str:
    """A fault each of its own failure, as a trainer reports them: its own in-process restart cycle and its
    own innermost frame. Faults of one failure (one cycle, or close in time without one) or a repeat of the
    one before (same class, type and frame) fold under their first on the page (``jobs.attribution``), so
    their own lines would never show there."""
    return (f"{marker}: BenchError('{marker}')\n\nTraceback (most recent call last):\n"
            f'  File "/bench/train_{i}.py", line {i + 1}, in step_{i}\n    raise BenchError\n'
            f"BenchError: {marker}")


def post(base: str, job_id: int, token: str, now: float, *, heartbeats=(), events=()) -> None:
    """Send one ingest batch sent at ``now``, as the bench's stand-in trainer does."""
    body = {"v": 1, "sent_at": now, "source": "bench", "heartbeats": list(heartbeats), "events": list(events)}
    req = urllib.request.Request(
        f"{base}/api/v1/jobs/{job_id}/ingest",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200, r.status


def measure_live(job, token: str, user, *, faults: int, app: str) -> list[float]:
    from django.contrib.sessions.backends.db import SessionStore

    session = SessionStore()
    session["_auth_user_id"] = str(user.pk)
    session["_auth_user_backend"] = "django.contrib.auth.backends.ModelBackend"
    session["_auth_user_hash"] = user.get_session_auth_hash()
    session.create()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            app,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--no-access-log",
            "--log-level",
            "warning",
        ],
        cwd=ROOT,
        env=env,
        start_new_session=True,
    )
    try:
        wait_up(base + "/login/")
        stop = threading.Event()

        def heartbeats():
            step = job.last_step
            while not stop.is_set():
                step += 1
                now = time.time()
                post(
                    base,
                    job.pk,
                    token,
                    now,
                    heartbeats=[
                        {
                            "rank": r,
                            "step": step,
                            "phase": "train",
                            "at": now,
                            "loss": 2.0,
                            "step_time_s": 0.5,
                            "node": f"node-{r // 8}",
                        }
                        for r in range(RANKS)
                    ],
                )
                stop.wait(1.0)

        beater = threading.Thread(target=heartbeats, daemon=True)
        beater.start()
        markers = [f"bench-live-fault-{i}" for i in range(faults)]
        client = PageClient(base, job.pk, session.session_key)
        watcher = threading.Thread(target=client.run, args=(markers,), daemon=True)
        watcher.start()
        time.sleep(2.0)  # the page is open and has its cursor
        rnd = random.Random(11)
        accepted: dict[str, float] = {}
        for i, marker in enumerate(markers):
            now = time.time()
            post(
                base,
                job.pk,
                token,
                now,
                events=[
                    {
                        "id": f"live-{i}",
                        "kind": "fault",
                        "at": now,
                        "rank": i % RANKS,
                        "data": {"fault": "exception", "message": live_fault_message(i, marker),
                                 "detected_by": "in_process", "cycle": f"a0-ij0-ip{i + 1}"},
                    }
                ],
            )
            accepted[marker] = time.monotonic()
            time.sleep(rnd.uniform(0.4, 1.2))
        deadline = time.monotonic() + 5
        while len(client.seen) < len(markers) and time.monotonic() < deadline:
            time.sleep(0.1)
        client.stop.set()
        stop.set()
        beater.join(5)  # no heartbeat in flight when the server goes away
        watcher.join(5)
        missing = [m for m in markers if m not in client.seen]
        if missing:
            raise SystemExit(f"{len(missing)} faults never reached the page: {missing[:3]}")
        print(f"polls={client.polls} unchanged_poll_bytes={client.bytes_unchanged}")
        return [client.seen[m] - accepted[m] for m in markers]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


def run_fleet(user, args) -> float:
    t = time.perf_counter()
    fleet = build_fleet_job(user, nodes=args.fleet_nodes)
    print(f"built fleet job #{fleet.pk}: {fleet.world_size} ranks in {time.perf_counter() - t:.1f} s")
    f = measure_fleet(fleet, user, requests=args.requests)
    print(f"fleet ranks={fleet.world_size} job_page_ms={f['job_page_ms']:.0f} timeline_ms={f['timeline_ms']:.0f} "
          f"ranks_ms={f['ranks_ms']:.0f} live_ms={f['live_ms']:.0f} page_bytes={f['page_bytes']} "
          f"n={args.requests}")
    return f["job_page_ms"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--checkpoints", type=int, default=2_000)
    ap.add_argument("--requests", type=int, default=9)
    ap.add_argument("--faults", type=int, default=40, help="fault events posted during the live measurement")
    ap.add_argument("--app", default="controlplane.asgi:application", help="the ASGI app uvicorn serves")
    ap.add_argument("--fleet-nodes", type=int, default=12_500,
                    help="nodes (x 8 ranks) of the large job whose page is measured too; 0 skips it")
    ap.add_argument("--fleet-only", action="store_true", help="measure only the large job's page")
    args = ap.parse_args()
    setup_django()
    if args.fleet_only:
        from django.contrib.auth.models import User

        User.objects.filter(username="bench").delete()  # a DATABASE_URL kept from an earlier run has it
        fleet_ms = run_fleet(User.objects.create_user("bench", password="bench-password-123"), args)
        print(f"fleet_job_page_ms={fleet_ms:.0f} n_page={args.requests}")
        return verdict({"fleet_job_page_ms": fleet_ms}, [Target("fleet_job_page_ms", "<=", 200)])
    t = time.perf_counter()
    job, token, user = build_job(
        num_events=args.events, num_checkpoints=args.checkpoints, num_cycles=100, num_faults=150
    )
    print(
        f"built job #{job.pk}: {args.events} events, {args.checkpoints} checkpoints, {RANKS} ranks "
        f"in {time.perf_counter() - t:.1f} s"
    )
    page_ms, times = measure_page(job, user, requests=args.requests)
    print("job page ms:", " ".join(f"{x:.0f}" for x in times))
    lat = sorted(measure_live(job, token, user, faults=args.faults, app=args.app))
    p95 = percentile(lat, 0.95)
    print(f"live latency s: p50={median(lat):.3f} p95={p95:.3f} max={lat[-1]:.3f} (n={len(lat)})")
    figures = {"job_page_ms": page_ms, "live_p95_s": p95}
    targets = [Target("job_page_ms", "<=", 150), Target("live_p95_s", "<=", 1.0)]
    if args.fleet_nodes:
        figures["fleet_job_page_ms"] = run_fleet(user, args)
        targets.append(Target("fleet_job_page_ms", "<=", 200))
    print(f"job_page_ms={page_ms:.0f} live_p95_s={p95:.2f} "
          f"fleet_job_page_ms={figures.get('fleet_job_page_ms', -1):.0f} "
          f"n_page={len(times)} n_live={len(lat)}")
    return verdict(figures, targets)


if __name__ == "__main__":
    sys.exit(main())
