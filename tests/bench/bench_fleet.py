"""Fleet benchmark (``make bench-fleet``): a 100,000-rank job through the real node agents, in the
production shape (tests/bench/prodshape.py: uvicorn with 2 workers and the ingest fast path, Redis,
Postgres, a Celery worker with beat running the watchdog).

The fleet: 12,500 nodes x 8 ranks, each node one real ``trainer.agent.NodeAgent`` (its ranks simulated,
thousands of agents multiplexed in a few shard processes: tests/bench/fleet.py), every rank beating once
per 2 s, every agent sending its node's spool upstream once per 2 s. Phases:

1. Heartbeats, stepped: the first N nodes beat for a while (N doubling up to the whole fleet); a step is
   *held* when the rank heartbeats the control plane accepted are at least 95 % of those offered, no
   request was shed (429) or failed, and the simulator kept its schedule (p99 lag under 0.5 s). Stepping
   stops at the first step not held. Each step prints its rates, the p99 of the agents' upstream
   requests, and each process's CPU; the ingest server's cost per core comes from the highest step held.
2. Commands: while the held fleet beats, an operator issues in-process restarts of single ranks through
   the operator API (``POST /api/v1/jobs/<id>/commands``, the service the UI's button calls);
   ``command_p99_s`` is from the POST to the moment the target rank's post to its agent, or its
   half-interval look at the agent's commands, is answered with the command (the rank then
   acknowledges it at once).
3. A job-wide in-job restart: every rank of the whole fleet posts the six cycle marks of one restart
   (600,000 marks); ``storm_drain_s`` is from the first post to the moment every mark is a row in the
   database (the cycle folded: one ``RestartCycle``), nan when that took longer than
   ``--storm-timeout-s`` (the line before says how many were stored by then). Then the agents send the
   rest (at most ``--tail-s``); ``lost`` = events the agents accepted from the ranks minus those of them
   stored (by the simulated ranks' own event ids, ``fleet-r*``) minus events still in the agents' spools
   (not sent yet, printed apart), over the whole run (command acks included; a replayed event counts
   once). Events the control plane writes itself (the failure policy's, the watchdog's straggler marks)
   are counted apart, by source, and never offset a loss.
4. The job page: ``GET /jobs/<id>/`` on the production server as a signed-in operator, the median of
   ``--page-requests`` after one warm-up, within ``--page-budget-s`` (loopback wall time: the server's
   time plus microseconds).

If the machine cannot hold the whole fleet it says so: the fraction held, the ingest server's node
requests per core, and the replicas those imply for 100,000 GPUs. The last line is exactly::

    ranks=<N> node_requests_per_s=<R> rank_heartbeats_per_s=<H> p99_ms=<P> worst_step_p99_ms=<W> \
storm_marks=<M> storm_drain_s=<D> lost=<L> job_page_ms=<J> command_p99_s=<C>

where N, R, H and P are those of the highest step held (the line before it says which) and W the worst
p99 of any heartbeat step; then the README row's targets, each met or MISSED (exit status 1 when one
is): ranks = 100,000 (the whole fleet held), p99 <= 50 ms, storm drained <= 10 s, lost = 0, job page
<= 200 ms, command p99 <= 4 s. Percentiles by nearest rank (tests/bench/stats.py).
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import multiprocessing
import random
import shutil
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainer.ports import free_port

import fleet
from prodshape import (
    bench_env,
    cpu_seconds,
    cpu_since,
    prepare,
    server_cpu,
    start_server,
    start_worker,
    stop,
    wait_http,
)
from stats import Target, median, percentile, verdict

OWN_DB = "postgres://postgres@127.0.0.1:5432/unbroken_bench_fleet"
OWN_REDIS = "redis://127.0.0.1:6379/10"
NAME = "bench-fleet"
PASSWORD = "bench-fleet-password-0123"
GPUS = 100_000  # the issue's job: what the replica count is for, whatever --nodes says


def log(msg: str) -> None:
    print(msg, flush=True)


pct = percentile  # nearest rank


class Fleet:
    """The shard processes, driven together."""

    def __init__(self, *, url: str, job_id: int, token: str, nodes: int, shards: int, threads: int,
                 interval_s: float, spool_root: Path):
        ctx = multiprocessing.get_context("spawn")  # no Django state or connections in the shards
        self.conns, self.procs = [], []
        for s in range(shards):
            parent, child = ctx.Pipe()
            kw = {"url": url, "job_id": job_id, "token": token, "nodes": list(range(s, nodes, shards)),
                  "spool_root": str(spool_root / f"shard-{s}"), "interval_s": interval_s, "threads": threads,
                  "seed": s}
            p = ctx.Process(target=fleet.shard_main, args=(child, kw), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        for c in self.conns:
            c.recv()  # ("ready", n)

    def start(self, op: str, **kw) -> None:
        for c in self.conns:
            c.send((op, kw))

    def results(self) -> list:
        return [c.recv() for c in self.conns]

    def run(self, **kw) -> dict:
        self.start("run", **kw)
        return merge(self.results())

    def seen(self) -> dict[int, float]:
        self.start("seen")
        out: dict[int, float] = {}
        for r in self.results():
            for k, v in r.items():
                out[k] = min(v, out.get(k, v))
        return out

    def spooled(self) -> int:
        self.start("spooled")
        return sum(self.results())

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self) -> None:
        self.start("stop")
        self.results()
        for p in self.procs:
            p.join(10)


def merge(parts: list[dict]) -> dict:
    return {"requests": [r for p in parts for r in p["requests"]], "lags": [x for p in parts for x in p["lags"]],
            "posts": sum(p["posts"] for p in parts), "events": sum(p["events"] for p in parts),
            "refused": sum(p["refused"] for p in parts), "pending": sum(p["pending"] for p in parts),
            "last_post_at": max(p["last_post_at"] for p in parts),
            "events_taken": sum(p["events_taken"] for p in parts)}


class Cpu:
    """CPU seconds of each part of the production shape (and of the simulator) between two marks."""

    def __init__(self, procs: dict[str, list[int]]):
        self.procs = procs

    def mark(self) -> dict:
        out = {k: cpu_seconds(v) for k, v in self.procs.items()}
        out["redis"] = server_cpu("redis-server")
        out["postgres"] = server_cpu("postgres")
        out["t"] = time.time()
        return out

    @staticmethod
    def since(a: dict, b: dict) -> dict[str, float]:
        wall = b["t"] - a["t"]
        out = {k: (b[k] - a[k]) / wall for k in a if k not in ("redis", "postgres", "t")}
        out["redis"] = cpu_since(a["redis"], b["redis"]) / wall
        out["postgres"] = cpu_since(a["postgres"], b["postgres"]) / wall
        return out  # cores busy on average


def heartbeat_step(fl: Fleet, cpu: Cpu, *, nodes: int, args: argparse.Namespace) -> dict:
    t0 = time.time() + 0.5
    fl.start("run", active=nodes, t0=t0, duration_s=args.warmup_s + args.step_s)
    time.sleep(max(0.0, t0 + args.warmup_s - time.time()))
    c0 = cpu.mark()
    time.sleep(max(0.0, t0 + args.warmup_s + args.step_s - time.time()))
    c1 = cpu.mark()
    res = merge(fl.results())
    lo, hi = t0 + args.warmup_s, t0 + args.warmup_s + args.step_s
    window = [r for r in res["requests"] if lo <= r[0] < hi]
    ok = [r for r in window if r[2] == "ok"]
    offered = nodes * fleet.RANKS_PER_NODE / args.interval_s
    out = {
        "nodes": nodes, "ranks": nodes * fleet.RANKS_PER_NODE,
        "node_requests_per_s": len(ok) / args.step_s,
        "rank_heartbeats_per_s": sum(r[3] for r in ok) / args.step_s,
        "offered_rank_heartbeats_per_s": offered,
        "p50_ms": pct([r[1] for r in ok], 0.5) * 1e3, "p99_ms": pct([r[1] for r in ok], 0.99) * 1e3,
        "not_ok": len(window) - len(ok), "lag_p99_s": pct(res["lags"], 0.99),
        "rank_posts_refused": res["refused"], "cpu": Cpu.since(c0, c1),
    }
    out["held"] = (out["rank_heartbeats_per_s"] >= args.hold * offered and out["not_ok"] == 0
                   and out["lag_p99_s"] < 0.5)
    drained = fl.run(active=nodes, t0=time.time(), duration_s=60.0, posts="none", until_drained=True)
    out["spool_left"] = drained["pending"]
    return out


def show_step(s: dict) -> None:
    c = s["cpu"]
    log(f"step {s['nodes']} nodes ({s['ranks']} ranks): held={s['held']} "
        f"node_requests_per_s={s['node_requests_per_s']:.0f} rank_heartbeats_per_s={s['rank_heartbeats_per_s']:.0f} "
        f"of {s['offered_rank_heartbeats_per_s']:.0f} offered p50_ms={s['p50_ms']:.1f} p99_ms={s['p99_ms']:.1f} "
        f"not_ok={s['not_ok']} sim_lag_p99_s={s['lag_p99_s']:.2f} spool_left={s['spool_left']} "
        f"cores: " + " ".join(f"{k}={v:.2f}" for k, v in c.items()))


class Neighbour:
    """Another job on the same control plane while the storm drains: its 2 ranks each post one heartbeat a
    second straight to the ingest (as standalone ranks do), each post timed; afterwards, whether the
    watchdog declared either lost. (A storm must not stall other jobs' heartbeats.)"""

    def __init__(self, base: str):
        import threading

        from controlplane.jobs.models import Job
        from controlplane.jobs.spec import JobSpec

        self.job = Job(name=f"{NAME}-neighbour-{int(time.time())}", spec=JobSpec(procs_per_node=2).to_dict(),
                       status="running")
        self.token = self.job.issue_token()
        self.job.save()
        self.url = f"{base}/api/v1/jobs/{self.job.pk}/ingest"
        self.times: list[float] = []
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        step = 0
        while not self._stop.wait(0.5):
            step += 1
            rank = step % 2
            body = json.dumps({"v": 1, "sent_at": time.time(), "source": f"rank:{rank}", "events": [],
                               "heartbeats": [{"rank": rank, "step": step, "phase": "train", "at": time.time()}]})
            req = urllib.request.Request(self.url, data=body.encode(), method="POST", headers={
                "Authorization": f"Bearer {self.token}", "Content-Type": "application/json"})
            t = time.perf_counter()
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    r.read()
                self.times.append(time.perf_counter() - t)
            except (OSError, urllib.error.HTTPError):
                self.failed += 1

    def start(self) -> Neighbour:
        self._thread.start()
        return self

    def stop(self) -> dict:
        from controlplane.jobs.models import Fault

        self._stop.set()
        self._thread.join(35)
        lost = Fault.objects.filter(job=self.job, fault_class="heartbeat_lost").count()
        return {"n": len(self.times), "p50_ms": pct(self.times, 0.5) * 1e3, "p99_ms": pct(self.times, 0.99) * 1e3,
                "max_ms": max(self.times, default=float("nan")) * 1e3, "failed": self.failed, "lost": lost}


def storm(fl: Fleet, cpu: Cpu, job, *, nodes: int, args: argparse.Namespace, base: str) -> dict:
    from controlplane.jobs.models import Event, RestartCycle

    expected = nodes * fleet.RANKS_PER_NODE * len(fleet.STORM_MARKS)
    before = Event.objects.filter(job=job, kind="cycle").count()
    t0 = time.time() + 0.5
    neighbour = Neighbour(base).start()
    fl.start("run", active=nodes, t0=t0, duration_s=args.storm_timeout_s, posts="storm", until_drained=True)
    c0 = cpu.mark()
    drained_at = None
    stored = before
    while time.time() < t0 + args.storm_timeout_s:
        time.sleep(0.5)
        stored = Event.objects.filter(job=job, kind="cycle").count()
        if stored - before >= expected:
            drained_at = time.time()
            break
    c1 = cpu.mark()
    other = neighbour.stop()
    res = merge(fl.results())
    cycles = RestartCycle.objects.filter(job=job, key=fleet.STORM_CYCLE)
    c = cycles.first()
    marks_set = sum(getattr(c, m.value) is not None for m, _ in fleet.STORM_MARKS) if c else 0
    ok = [r for r in res["requests"] if r[2] == "ok"]
    return {"marks": res["events"], "stored": stored - before, "expected": expected,
            "drain_s": (drained_at - t0) if drained_at else float("nan"),
            "posted_s": res["last_post_at"] - t0, "requests": len(ok), "not_ok": len(res["requests"]) - len(ok),
            "p99_ms": pct([r[1] for r in ok], 0.99) * 1e3, "cycles": cycles.count(), "marks_set": marks_set,
            "spool_left": res["pending"], "cpu": Cpu.since(c0, c1), "wall_s": c1["t"] - c0["t"],
            "neighbour": other}


def job_page(base: str, job_id: int, sessionid: str, *, requests: int, budget_s: float) -> tuple[float, int, int]:
    """Median wall ms of GET /jobs/<id>/ after one warm-up (at most ``budget_s`` in all), body bytes, count."""
    times: list[float] = []
    size = 0
    t_end = time.time() + budget_s
    for i in range(requests + 1):
        req = urllib.request.Request(f"{base}/jobs/{job_id}/", headers={"Cookie": f"sessionid={sessionid}"})
        t = time.perf_counter()
        with urllib.request.urlopen(req, timeout=budget_s) as r:
            body = r.read()
            assert r.status == 200 and b"login" not in r.url.encode(), r.url
        size = len(body)
        if i:
            times.append((time.perf_counter() - t) * 1e3)
        if time.time() > t_end:
            break
    return median(times), size, len(times)


def commands(fl: Fleet, base: str, job_id: int, *, nodes: int, args: argparse.Namespace) -> list[float]:
    auth = "Basic " + base64.b64encode(f"{NAME}:{PASSWORD}".encode()).decode()
    rng = random.Random(9)
    t0 = time.time() + 0.5
    duration = args.warmup_s + args.commands * args.command_every_s + 2 * args.interval_s + 2
    fl.start("run", active=nodes, t0=t0, duration_s=duration)
    issued: dict[int, float] = {}
    for i in range(args.commands):
        time.sleep(max(0.0, t0 + args.warmup_s + i * args.command_every_s - time.time()))
        rank = rng.randrange(nodes * fleet.RANKS_PER_NODE)
        body = json.dumps({"kind": "restart", "level": "in_process", "rank": rank}).encode()
        req = urllib.request.Request(f"{base}/api/v1/jobs/{job_id}/commands", data=body, method="POST",
                                     headers={"Authorization": auth, "Content-Type": "application/json"})
        t = time.time()
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                issued[json.loads(r.read())["id"]] = t
        except urllib.error.HTTPError as e:
            log(f"command refused: HTTP {e.code} {e.read()[:300]!r}")
    fl.results()
    seen = fl.seen()
    return [seen[c] - t if c in seen else float("inf") for c, t in issued.items()]


def setup_job(*, ranks: int, interval_s: float):
    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.test import Client

    from controlplane.jobs.models import Job
    from controlplane.jobs.spec import JobSpec

    old = list(Job.objects.filter(name__startswith=NAME).values_list("pk", flat=True))
    if old:  # big tables in one statement each (the ORM's cascade would load every row first)
        with connection.cursor() as cur:
            for table in ("jobs_rank", "jobs_event", "jobs_trainingsample"):
                cur.execute(f"DELETE FROM {table} WHERE job_id = ANY(%s)", [old])  # noqa: S608 - the tables above
        Job.objects.filter(pk__in=old).delete()
        with connection.cursor() as cur:
            cur.execute("VACUUM ANALYZE jobs_rank")
            cur.execute("VACUUM ANALYZE jobs_event")
    # One "node" of ``ranks`` processes on the local backend (as bench-ingest's job): the launcher has
    # nothing to start or watch; the heartbeats name the simulated nodes.
    spec = JobSpec(procs_per_node=ranks, heartbeat_interval_s=interval_s, step_timeout_s=600.0,
                   checkpoint_timeout_s=900.0, stall_timeout_s=900.0, node_agent=True)
    job = Job(name=f"{NAME}-{int(time.time())}", spec=spec.to_dict(), status="running")
    token = job.issue_token()
    job.save()
    User = get_user_model()
    User.objects.filter(username=NAME).delete()
    user = User.objects.create_superuser(NAME, password=PASSWORD)
    c = Client()
    c.force_login(user)
    return job, token, c.cookies["sessionid"].value


def main() -> int:
    p = argparse.ArgumentParser(description="Fleet benchmark: 100,000 ranks through the real node agents")
    p.add_argument("--nodes", type=int, default=12_500)
    p.add_argument("--interval-s", type=float, default=2.0, help="the ranks' and the agents' interval")
    p.add_argument("--first-step", type=int, default=250, help="nodes in the first heartbeat step (then doubling)")
    p.add_argument("--step-s", type=float, default=8.0, help="each heartbeat step's measured time")
    p.add_argument("--warmup-s", type=float, default=4.0)
    p.add_argument("--hold", type=float, default=0.95, help="share of the offered heartbeats that counts as held")
    p.add_argument("--shards", type=int, default=2, help="simulator processes")
    p.add_argument("--threads", type=int, default=32, help="sender threads per simulator process")
    p.add_argument("--storm-timeout-s", type=float, default=300.0)
    p.add_argument("--tail-s", type=float, default=90.0, help="at most this long to send the storm's rest")
    p.add_argument("--page-requests", type=int, default=5)
    p.add_argument("--page-budget-s", type=float, default=60.0)
    p.add_argument("--commands", type=int, default=8)
    p.add_argument("--command-every-s", type=float, default=1.3)
    p.add_argument("--workers", type=int, default=2, help="uvicorn worker processes")
    p.add_argument("--celery-concurrency", type=int, default=2)
    args = p.parse_args()
    t_start = time.time()
    # `timeout` (or a Ctrl-C in another terminal) sends SIGTERM: unwind through the `finally` below, so the
    # server, the Celery worker and the fleet's processes are stopped, not left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    tmp = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    env = bench_env(tmp, db=OWN_DB, redis=OWN_REDIS)
    prepare(env, own_redis=OWN_REDIS)
    ranks = args.nodes * fleet.RANKS_PER_NODE
    job, token, sessionid = setup_job(ranks=ranks, interval_s=args.interval_s)
    from django.db import connection

    connection.close()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = start_server(env, port, workers=args.workers)
    worker = start_worker(env, tmp / "beat", concurrency=args.celery_concurrency)
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp
    spool_root = Path(tempfile.mkdtemp(prefix="bench-fleet-spool-", dir=shm))
    fl = None
    try:
        wait_http(f"{base}/api/v1/openapi.json")
        t = time.time()
        fl = Fleet(url=base, job_id=job.pk, token=token, nodes=args.nodes, shards=args.shards, threads=args.threads,
                   interval_s=args.interval_s, spool_root=spool_root)
        log(f"job {job.pk}: {args.nodes} node agents ({ranks} ranks) in {args.shards} processes, "
            f"built in {time.time() - t:.1f} s")
        cpu = Cpu({"server": [server.pid], "celery": [worker.pid], "simulator": fl.pids})

        steps, n = [], args.first_step
        while True:
            n = min(n, args.nodes)
            s = heartbeat_step(fl, cpu, nodes=n, args=args)
            steps.append(s)
            show_step(s)
            if not s["held"] or n == args.nodes:
                break
            n *= 2
        held = [s for s in steps if s["held"]]
        best = held[-1] if held else steps[0]

        # Commands first, while the held fleet beats with nothing queued: after the storm the agents'
        # sends would wait behind its backlog (one send per node at a time), which is the storm's figure.
        delivery = commands(fl, base, job.pk, nodes=best["nodes"], args=args)
        log(f"commands at {best['ranks']} ranks beating: delivery s " + " ".join(f"{d:.2f}" for d in sorted(delivery)))

        st = storm(fl, cpu, job, nodes=args.nodes, args=args, base=base)
        log(f"storm: {st['marks']} cycle marks posted by {ranks} ranks (posting took {st['posted_s']:.1f} s), "
            f"{st['stored']} stored after {args.storm_timeout_s:.0f} s at most, drained in {st['drain_s']:.1f} s; "
            f"{st['requests']} agent requests (p99 {st['p99_ms']:.0f} ms, {st['not_ok']} not ok); restart cycles for "
            f"it: {st['cycles']} ({st['marks_set']} of 6 marks set); spool files left {st['spool_left']}")
        nb = st["neighbour"]
        log(f"another job's heartbeats while the storm drained: {nb['n']} posts, p50 {nb['p50_ms']:.0f} ms, "
            f"p99 {nb['p99_ms']:.0f} ms, max {nb['max_ms']:.0f} ms, {nb['failed']} failed; its ranks declared "
            f"lost: {nb['lost']}")
        sc = st["cpu"]
        per_core = st["stored"] / st["wall_s"] / max(1e-9, sc["server"])
        db_per_core = st["stored"] / st["wall_s"] / max(1e-9, sc["postgres"])
        log("storm cost: cores busy on average while it drained: " + " ".join(f"{k}={v:.2f}" for k, v in sc.items())
            + f"; {st['stored'] / st['wall_s']:.0f} marks stored/s = {per_core:.0f} marks/s per ingest server core, "
            f"{db_per_core:.0f} per Postgres core; a {st['expected']}-mark storm drained in 10 s needs "
            f"{math.ceil(st['expected'] / 10 / per_core)} ingest worker cores and "
            f"{math.ceil(st['expected'] / 10 / db_per_core)} Postgres cores at that cost")
        t = time.time()
        tail = fl.run(active=args.nodes, t0=t, duration_s=args.tail_s, posts="none", until_drained=True)
        from django.db.models import Count

        from controlplane.jobs.models import Event, Rank

        sent = tail["events_taken"]
        stored = Event.objects.filter(job=job, event_id__startswith="fleet-r").count()  # the ranks' own
        server_made = dict(Event.objects.filter(job=job).exclude(event_id__startswith="fleet-r")
                           .values_list("source").annotate(n=Count("id")).values_list("source", "n"))
        spooled = fl.spooled()  # not sent yet: still on the agents' disks, neither stored nor lost
        lost = sent - stored - spooled
        log(f"events: {sent} accepted by the agents from the ranks, {stored} of them stored, {spooled} still "
            f"in the agents' spools ({tail['pending']} files) after {time.time() - t:.0f} s more of sending; "
            f"lost = {sent} - {stored} - {spooled}; stored events no rank sent (the control plane's own, by "
            f"source, not counted above): {server_made or 'none'}")

        t = time.time()
        while time.time() < t + 15 and Rank.objects.filter(job=job).count() < ranks:
            time.sleep(0.5)
        num_rank_rows = Rank.objects.filter(job=job).count()
        page_ms, page_bytes, page_n = job_page(base, job.pk, sessionid, requests=args.page_requests,
                                               budget_s=args.page_budget_s)
        log(f"job page: {page_bytes} bytes, {num_rank_rows} rank rows, median of {page_n}: {page_ms:.0f} ms")

        rps_core = best["node_requests_per_s"] / max(1e-9, best["cpu"]["server"])
        full_rps = GPUS / fleet.RANKS_PER_NODE / args.interval_s
        stack = sum(v for k, v in best["cpu"].items() if k != "simulator")
        log(f"cost: the ingest server took {best['cpu']['server']:.2f} cores for {best['node_requests_per_s']:.0f} "
            f"node requests/s = {rps_core:.0f} node requests/s per core "
            f"({rps_core * fleet.RANKS_PER_NODE:.0f} rank heartbeats/s per core); the whole control plane "
            f"(server, Celery, Redis, Postgres) {stack:.2f} cores = "
            f"{best['node_requests_per_s'] / max(1e-9, stack):.0f} node requests/s per core; the simulated fleet "
            f"{best['cpu']['simulator']:.2f} cores")
        log(f"{GPUS:,} GPUs at a {args.interval_s:g} s interval = {full_rps:.0f} node requests/s: "
            f"{math.ceil(full_rps / rps_core)} ingest worker cores at the measured cost (one uvicorn worker per "
            f"core: {math.ceil(full_rps / rps_core)} single-worker replicas, or "
            f"{math.ceil(full_rps / rps_core / 2)} of 2 workers), plus Redis and Postgres at "
            f"{(best['cpu']['redis'] + best['cpu']['postgres']) / max(1e-9, best['node_requests_per_s']) * full_rps:.1f} "
            f"cores at the same rate")
        fraction = best["ranks"] / ranks if best["held"] else 0.0
        if best["held"] and best["ranks"] == ranks:
            log(f"held: the whole fleet ({ranks} ranks) at a {args.interval_s:g} s interval")
        else:
            log(f"NOT held: this machine holds {best['ranks'] if best['held'] else 0} of {ranks} ranks "
                f"({fraction:.1%}) at a {args.interval_s:g} s interval; ranks, node_requests_per_s, "
                f"rank_heartbeats_per_s and p99_ms below are measured at {best['ranks']} ranks "
                f"({'the highest step held' if best['held'] else 'the first step, not held'}), not scaled up; "
                f"the storm and the job page are the whole fleet's ({ranks} ranks)")
        log(f"run took {time.time() - t_start:.0f} s")
        worst = max(s["p99_ms"] for s in steps)
        per_step = ", ".join(f"{x['ranks']} ranks {x['p99_ms']:.1f}" for x in steps)
        log(f"heartbeat steps' p99_ms: {per_step}; "
            f"commands n={len(delivery)}, page loads n={page_n}, storm marks n={st['expected']}")
        figures = {"ranks": best["ranks"] if best["held"] else 0, "p99_ms": best["p99_ms"],
                   "worst_step_p99_ms": worst, "storm_drain_s": st["drain_s"], "lost": lost,
                   "job_page_ms": page_ms, "command_p99_s": pct(delivery, 0.99)}
        log(f"ranks={best['ranks']} node_requests_per_s={best['node_requests_per_s']:.0f} "
            f"rank_heartbeats_per_s={best['rank_heartbeats_per_s']:.0f} p99_ms={best['p99_ms']:.1f} "
            f"worst_step_p99_ms={worst:.1f} "
            f"storm_marks={st['marks']} storm_drain_s={st['drain_s']:.1f} lost={lost} job_page_ms={page_ms:.0f} "
            f"command_p99_s={pct(delivery, 0.99):.2f}")
        status = verdict(figures, [Target("ranks", ">=", GPUS), Target("p99_ms", "<=", 50),
                                   Target("storm_drain_s", "<=", 10), Target("lost", "==", 0),
                                   Target("job_page_ms", "<=", 200), Target("command_p99_s", "<=", 4)])
    finally:
        if fl is not None:
            fl.stop()
        stop(server)
        stop(worker)
        shutil.rmtree(spool_root, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
