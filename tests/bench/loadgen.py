"""Load generator for the ingest API: many simulated ranks, batched heartbeats, over loopback.

Open loop: every rank beats once per ``interval_s``; ranks are grouped into batches of ``batch_size``
(one batch = one reporter's POST), and the groups' sends are spread evenly over the interval. Requests
go out on ``connections`` keep-alive HTTP/1.1 connections (raw asyncio streams, so the generator costs
little of the CPU it shares with the server). Bodies are pre-rendered templates; only the timestamp
and step are substituted per send.

Latency is measured from the scheduled send time to the end of the response, so a server that falls
behind shows up in the latency (no coordinated omission), and achieved throughput is counted from
heartbeats in 200 responses only.

Usable as a library (``run``) or from the command line::

    python tests/bench/loadgen.py --url http://127.0.0.1:8000 --job 1 --token ubk_... --ranks 65536
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

from stats import percentile


@dataclass
class LoadResult:
    sent: int = 0
    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    heartbeats_ok: int = 0
    heartbeats_sent: int = 0  # in the measured window (the silent rank's missing beats are not sent)
    latencies_s: list[float] = field(default_factory=list)
    due_s: list[float] = field(default_factory=list)  # each latency's scheduled send, seconds into the run
    started: float = 0.0
    finished: float = 0.0
    silent_last_at: float | None = None  # the silent rank's last heartbeat time (its clock = ours)
    max_lag_s: float = 0.0  # how far the sender fell behind its schedule
    last_sent_at: dict[int, float] = field(default_factory=dict)  # per group: its last beats' time

    @property
    def duration_s(self) -> float:
        return max(1e-9, self.finished - self.started)

    def worst_seconds(self, n: int = 5) -> list[tuple[int, float]]:
        """The ``n`` one-second windows with the highest maximum latency: (second into the run, max s)."""
        worst: dict[int, float] = {}
        for d, lat in zip(self.due_s, self.latencies_s, strict=True):
            worst[int(d)] = max(worst.get(int(d), 0.0), lat)
        return sorted(worst.items(), key=lambda kv: -kv[1])[:n]

    def pct(self, q: float) -> float:
        return percentile(self.latencies_s, q)  # nearest rank


def render_group(ranks: range, *, node: str, skip: int | None = None) -> bytes:
    """A batch body template for ``ranks``; ``@T@`` is the timestamp, ``@S@`` the step."""
    beats = []
    for r in ranks:
        if r == skip:
            continue
        beats.append(f'{{"rank":{r},"step":@S@,"phase":"train","at":@T@,"loss":2.5,"step_time_s":0.25,'
                     f'"tokens_per_s":16384.0,"node":"{node}","pid":{10000 + r % 50000}}}')
    return ('{"v":1,"sent_at":@T@,"source":"' + node + '","heartbeats":[' + ",".join(beats) + '],"events":[]}').encode()


class Conn:
    def __init__(self, host: str, port: int, head: bytes):
        self.host, self.port, self.head = host, port, head
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        req = (b"POST " + path.encode() + b" HTTP/1.1\r\n" + self.head
               + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        try:
            self.writer.write(req)
            await self.writer.drain()
            head = await self.reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            payload = await self.reader.readexactly(length) if length else b""
            if b"connection: close" in head.lower():
                self.close()
            return status, payload
        except (OSError, asyncio.IncompleteReadError, ValueError):
            self.close()
            raise

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def run(url: str, job_id: int, token: str, *, ranks: int = 65536, batch_size: int = 512,
              interval_s: float = 1.0, duration_s: float = 20.0, connections: int = 32,
              silent_rank: int | None = None, silent_after_s: float = 5.0, warmup_s: float = 0.0) -> LoadResult:
    u = urlparse(url)
    host, port = u.hostname or "127.0.0.1", u.port or 80
    path = f"/api/v1/jobs/{job_id}/ingest"
    head = (f"Host: {host}:{port}\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\n"
            "Connection: keep-alive\r\n").encode()
    groups = [range(g, min(g + batch_size, ranks)) for g in range(0, ranks, batch_size)]
    templates = [render_group(g, node=f"node-{i:04d}") for i, g in enumerate(groups)]
    silent_group = None if silent_rank is None else silent_rank // batch_size
    silent_template = None if silent_group is None else render_group(groups[silent_group],
                                                                      node=f"node-{silent_group:04d}", skip=silent_rank)
    res = LoadResult()
    queue: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    t0 = loop.time() + 0.2
    measure_from = t0 + warmup_s
    end = t0 + warmup_s + duration_s
    step_of = lambda t: 1 + int((t - t0) / interval_s)  # noqa: E731

    async def producer() -> None:
        k = 0
        while True:
            for gi in range(len(groups)):
                due = t0 + k * interval_s + gi * interval_s / len(groups)
                if due >= end:
                    return
                delay = due - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                await queue.put((due, gi))
            k += 1

    async def sender(conn: Conn) -> None:
        while True:
            item = await queue.get()
            if item is None:
                return
            due, gi = item
            now = loop.time()
            res.max_lag_s = max(res.max_lag_s, now - due)
            silent = silent_group == gi and now >= t0 + warmup_s + silent_after_s
            tpl = silent_template if silent else templates[gi]
            ts = time.time()
            if silent_group == gi and not silent:
                res.silent_last_at = ts
            res.last_sent_at[gi] = ts
            body = tpl.replace(b"@S@", str(step_of(now)).encode()).replace(b"@T@", repr(ts).encode())
            n_beats = len(groups[gi]) - (1 if silent else 0)
            counted = due >= measure_from
            if counted:
                res.sent += 1
                res.heartbeats_sent += n_beats
            try:
                status, _ = await conn.post(path, body)
            except Exception as e:  # noqa: BLE001 - a refused or reset connection is a result, not a crash
                if counted:
                    res.errors[type(e).__name__] = res.errors.get(type(e).__name__, 0) + 1
                continue
            if not counted:
                continue
            if status == 200:
                res.ok += 1
                res.heartbeats_ok += n_beats
                res.latencies_s.append(loop.time() - due)
                res.due_s.append(due - measure_from)
            else:
                res.errors[str(status)] = res.errors.get(str(status), 0) + 1

    conns = [Conn(host, port, head) for _ in range(connections)]
    res.started = time.time() + (t0 - loop.time()) + warmup_s
    workers = [asyncio.create_task(sender(c)) for c in conns]
    await producer()
    for _ in workers:
        await queue.put(None)
    await asyncio.gather(*workers)
    res.finished = time.time()
    for c in conns:
        c.close()
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--job", type=int, required=True)
    p.add_argument("--token", required=True)
    p.add_argument("--ranks", type=int, default=65536)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--interval-s", type=float, default=1.0)
    p.add_argument("--duration-s", type=float, default=20.0)
    p.add_argument("--connections", type=int, default=32)
    a = p.parse_args()
    r = asyncio.run(run(a.url, a.job, a.token, ranks=a.ranks, batch_size=a.batch_size, interval_s=a.interval_s,
                        duration_s=a.duration_s, connections=a.connections))
    print(json.dumps({"rank_heartbeats_per_s": round(r.heartbeats_ok / r.duration_s), "p50_ms": r.pct(0.5) * 1e3,
                      "p99_ms": r.pct(0.99) * 1e3, "errors": r.errors, "max_lag_s": r.max_lag_s}))


if __name__ == "__main__":
    main()
