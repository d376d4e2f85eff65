"""A simulated fleet for ``make bench-fleet``: many nodes' real node agents (trainer/agent.py), their ranks
simulated, multiplexed in one process (a shard).

Each node is one ``NodeAgent`` with its own disk spool (under /dev/shm when there is one). Its loopback
HTTP server is closed at once: the simulated ranks of the node hand their batches to ``take()`` directly
(the same call the server's handler makes), and a small thread pool calls ``send_pending()`` for each
node once per interval, as the agent's own sender thread would (one call per node at a time, never
two). So the bytes a rank posts, the spool, the merged upstream batch, the 429 hold-off and the
command cache are the product's own code; only the transport between rank and agent and the threads
are the simulator's.

A rank posts at its own phase in the interval, independent of its agent's (as a real rank's reporter
is): one heartbeat per interval, plus a ``command_ack`` event for a command it saw in the agent's last
answer to it, and half an interval after its post a look at the agent's commands (``NodeAgent.poll``,
what the rank's reporter does with a loopback GET). ``FleetAgent._send`` times every upstream request.

The shard runs in a child process and is driven over a pipe (``Shard.serve``); the bench's main process
(tests/bench/bench_fleet.py) collects what each phase measured.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from trainer.agent import NodeAgent
from trainer.reporter import OK
from trainer.wire import CycleMark, EventKind, Layer

RANKS_PER_NODE = 8
STORM_CYCLE = "a0-ij1"
# The marks of one in-job restart as every rank reports it, seconds before the rank's post.
STORM_MARKS = ((CycleMark.FAULT, 2.0), (CycleMark.DETECTED, 1.9), (CycleMark.ABORTED, 1.7),
               (CycleMark.RESTARTED, 1.0), (CycleMark.CHECKPOINT_LOADED, 0.5), (CycleMark.FIRST_STEP, 0.0))


class FleetAgent(NodeAgent):
    """The node agent, with each upstream request timed (the product's ``_send``, called as it is)."""

    shard: Shard

    def _send(self, batch: dict[str, Any]) -> str:
        t = time.perf_counter()
        verdict = super()._send(batch)
        end = time.time()
        self.shard.requests.append((end, time.perf_counter() - t, verdict,
                                    len(batch.get("heartbeats", [])) if verdict == OK else 0,
                                    len(batch.get("events", [])) if verdict == OK else 0))
        return verdict


@dataclass
class Node:
    index: int
    agent: FleetAgent
    rank_phase: float  # where in the interval its ranks post (a fraction)
    busy: bool = False
    acks: dict[int, list[int]] = field(default_factory=dict)  # rank -> command ids to acknowledge


class Shard:
    def __init__(self, *, url: str, job_id: int, token: str, nodes: list[int], spool_root: str,
                 interval_s: float, threads: int, seed: int = 0):
        self.job_id, self.interval_s = str(job_id), interval_s
        self.auth = f"Bearer {token}".encode()
        rng = random.Random(seed)
        self.nodes: list[Node] = []
        for i in nodes:
            agent = FleetAgent(upstream=url, job_id=str(job_id), token=token,
                               spool_dir=os.path.join(spool_root, f"node-{i:05d}"), interval_s=interval_s)
            agent.server.server_close()  # the ranks call take() here; no loopback server per node
            agent.source = f"agent:node-{i:05d}"
            agent.shard = self
            self.nodes.append(Node(i, agent, rng.random()))
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="fleet-send")
        self.requests: list[tuple[float, float, str, int, int]] = []
        self.posts_ok = 0
        self.posts_refused = 0
        self.events_taken = 0
        self.seen: dict[int, float] = {}  # command id -> when its target rank first saw it
        self.last_post_at = 0.0
        self._seq = 0
        self._step = 1

    # -- a rank's post -------------------------------------------------------------------------------

    def _post(self, node: Node, rank: int, body: dict[str, Any]) -> None:
        status, payload = node.agent.take(self.job_id, self.auth, json.dumps(body, separators=(",", ":")).encode())
        if status != 200:
            self.posts_refused += 1
            return
        self.posts_ok += 1
        self.last_post_at = time.time()
        self.events_taken += len(body["events"])
        self._look(node, rank, payload["commands"])

    def _poll(self, node: Node, rank: int) -> None:
        """A rank's reporter asking its agent for commands half-way through its interval (``poll`` is the
        call the agent's GET handler makes)."""
        status, payload = node.agent.poll(self.job_id, self.auth)
        if status == 200:
            self._look(node, rank, payload["commands"])

    def _look(self, node: Node, rank: int, commands: list[dict[str, Any]]) -> None:
        for c in commands:
            if c["rank"] == rank and c["id"] not in self.seen:
                self.seen[c["id"]] = time.time()
                node.acks.setdefault(rank, []).append(c["id"])

    def _beat(self, node: Node, rank: int, *, phase: str = "train", events: list[dict] | None = None) -> None:
        now = time.time()
        events = list(events or [])
        for cid in node.acks.pop(rank, []):
            events.append(self._event(EventKind.COMMAND_ACK, rank, now, {"command_id": cid, "ok": True}))
        self._post(node, rank, {
            "v": 1, "sent_at": now, "source": f"rank:{rank}", "events": events,
            "heartbeats": [{"rank": rank, "step": self._step, "phase": phase, "at": now, "loss": 2.5,
                            "step_time_s": 0.25, "tokens_per_s": 16384.0, "node": f"node-{node.index:05d}",
                            "pid": 10000 + rank % RANKS_PER_NODE}]})

    def _event(self, kind: str, rank: int, at: float, data: dict[str, Any]) -> dict[str, Any]:
        self._seq += 1
        return {"id": f"fleet-r{rank}-p{os.getpid()}-{self._seq}", "kind": kind, "at": at, "rank": rank, "data": data}

    def _storm(self, node: Node, rank: int) -> None:
        now = time.time()
        marks = [self._event(EventKind.CYCLE, rank, now - ago, {
            "cycle": STORM_CYCLE, "layer": Layer.IN_JOB, "mark": mark,
            **({"step": self._step} if mark in (CycleMark.FAULT, CycleMark.CHECKPOINT_LOADED,
                                                CycleMark.FIRST_STEP) else {})})
            for mark, ago in STORM_MARKS]
        self._beat(node, rank, events=marks)

    # -- the agents' sends ---------------------------------------------------------------------------

    def _send(self, node: Node) -> None:
        try:
            node.agent.send_pending()
        finally:
            node.busy = False

    def _kick(self, node: Node) -> None:
        if not node.busy:
            node.busy = True
            self.pool.submit(self._send, node)

    # -- phases --------------------------------------------------------------------------------------

    def run(self, *, active: int, t0: float, duration_s: float, posts: str = "beat",
            until_drained: bool = False) -> dict[str, Any]:
        """From ``t0`` (wall clock) for ``duration_s``: the agents of the nodes with index < ``active`` send
        once per interval, each at its own phase, and their ranks post at theirs: a heartbeat each
        (``posts="beat"``), one in-job restart's marks each in the first interval only (``"storm"``), or
        nothing (``"none"``: the agents send what they spooled). ``until_drained``: stop after the first
        interval that ends with every spool empty."""
        nodes = [n for n in self.nodes if n.index < active]
        slots = [(n.index / active, 0, n) for n in nodes] + [(n.rank_phase, 1, n) for n in nodes]
        if posts == "beat":  # the ranks' half-interval look at their agent's commands (trainer/reporter.py)
            slots += [((n.rank_phase + 0.5) % 1.0, 2, n) for n in nodes]
        slots.sort(key=lambda s: s[:2])
        self.requests, lags = [], []
        posts0, events0 = self.posts_ok, self.events_taken
        end, k = t0 + duration_s, 0
        while not (until_drained and k and not self.pending(active)):
            for frac, kind, node in slots:
                due = t0 + (k + frac) * self.interval_s
                if due >= end:
                    break
                delay = due - time.time()
                if delay > 0:
                    time.sleep(delay)
                lags.append(max(0.0, -delay))
                if kind == 0:
                    self._kick(node)
                elif kind == 2:
                    for r in range(RANKS_PER_NODE):
                        self._poll(node, node.index * RANKS_PER_NODE + r)
                elif posts == "beat":
                    for r in range(RANKS_PER_NODE):
                        self._beat(node, node.index * RANKS_PER_NODE + r)
                elif posts == "storm" and k == 0:
                    for r in range(RANKS_PER_NODE):
                        self._storm(node, node.index * RANKS_PER_NODE + r)
            else:
                k += 1
                self._step += 1
                continue
            break
        while any(n.busy for n in nodes) and time.time() < end + 30:
            time.sleep(0.05)
        return {"requests": self.requests, "lags": lags, "posts": self.posts_ok - posts0,
                "events": self.events_taken - events0, "refused": self.posts_refused, "pending": self.pending(active),
                "last_post_at": self.last_post_at, "events_taken": self.events_taken}

    def pending(self, active: int) -> int:
        return sum(len(n.agent.spool.pending()) for n in self.nodes if n.index < active)

    def spooled_events(self) -> int:
        """Events the agents hold on disk, not sent yet (neither stored nor lost)."""
        n = 0
        for node in self.nodes:
            for name in node.agent.spool.pending():
                n += len((node.agent.spool.load(name) or {}).get("events", []))
        return n

    def serve(self, conn: Any) -> None:
        """Answer the bench's messages: ("run", kwargs) | ("drain", kwargs) | ("seen", None) | ("spooled", None) | ("stop", None)."""
        conn.send(("ready", len(self.nodes)))
        while True:
            op, kw = conn.recv()
            if op == "run":
                conn.send(self.run(**kw))
            elif op == "spooled":
                conn.send(self.spooled_events())
            elif op == "seen":
                conn.send(dict(self.seen))
            elif op == "stop":
                self.pool.shutdown(wait=True)
                conn.send(None)
                return


def shard_main(conn: Any, kwargs: dict[str, Any]) -> None:
    """A shard process: build the agents, then serve the bench over ``conn``."""
    import logging

    logging.basicConfig(level=logging.ERROR)  # the agents' 429 and refusal logs are counted, not printed
    spool_root = kwargs["spool_root"]
    try:
        Shard(**kwargs).serve(conn)
    finally:
        shutil.rmtree(spool_root, ignore_errors=True)
