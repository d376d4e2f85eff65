"""Reporting to the control plane: heartbeats and events (trainer/wire.py), commands back.

``Reporter`` is a protocol (heartbeat / event / close). ``HttpReporter`` only appends to a deque on the
caller's thread; a background thread batches, POSTs, and on an unreachable control plane (connection
error, timeout, 5xx, 429) spools batches to disk and replays them in order once it is back. A 4xx other
than 429 means the batch will never be accepted: the server's JSON error is logged and the batch
dropped. Event ids are unique per process, so a replay after an unseen success is harmless.
``NullReporter`` is used when no URL is set.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import random
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from trainer.wire import MAX_EVENTS, MAX_HEARTBEATS, WIRE_VERSION, Event, EventKind, Heartbeat, as_dict

log = logging.getLogger(__name__)

_UNSET: Any = object()

#: Events sent when they happen, not at the next interval: an ack (the operator is waiting on it) and a
#: rank's start (a rank its launcher stops within its first interval, a peer having failed at once, would
#: otherwise be a rank the control plane never saw start).
_SENT_AT_ONCE = frozenset({EventKind.COMMAND_ACK, EventKind.RANK_STARTED})


class Reporter(Protocol):
    def heartbeat(self, *, step: int, phase: str, loss: float | None = None, step_time_s: float | None = None,
                  tokens_per_s: float | None = None, busy_s: float | None = None) -> None: ...

    def event(self, kind: EventKind | str, data: dict[str, Any] | None = None, *, rank: int | None = _UNSET,
              at: float | None = None) -> None: ...

    def flush(self) -> None:
        """Send what is queued now, not at the next interval (without waiting for it)."""

    def close(self, timeout_s: float = 5.0) -> None: ...


class NullReporter:
    def heartbeat(self, **_: Any) -> None:
        pass

    def event(self, *_: Any, **__: Any) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self, timeout_s: float = 5.0) -> None:
        pass


def _finite(v: float | None) -> float | None:
    return v if v is None or math.isfinite(v) else None


class Spool:
    """Batches waiting for the control plane, one JSON file each, replayed oldest first.

    One directory per source (``rank0``, ``launcher``): a restarted process of the same rank picks up
    what its predecessor could not send, in order.
    """

    def __init__(self, path: str):
        self.path = path
        self._seq = 0
        os.makedirs(path, exist_ok=True)

    def append(self, batch: dict[str, Any]) -> None:
        self._seq += 1
        name = f"{time.time_ns():020d}-{os.getpid()}-{self._seq:08d}.json"
        tmp = os.path.join(self.path, f".{name}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(batch, f, separators=(",", ":"))
        os.replace(tmp, os.path.join(self.path, name))

    def pending(self) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.path) if n.endswith(".json") and not n.startswith("."))
        except FileNotFoundError:
            return []

    def load(self, name: str) -> dict[str, Any] | None:
        try:
            with open(os.path.join(self.path, name), encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def remove(self, name: str) -> None:
        try:
            os.unlink(os.path.join(self.path, name))
        except FileNotFoundError:
            pass


OK, RETRY, DROP = "ok", "retry", "drop"


class HttpReporter:
    """Background-thread HTTP reporter. Public methods never block on I/O and never raise."""

    def __init__(self, *, url: str, job_id: str, token: str, source: str, rank: int | None, spool_dir: str,
                 interval_s: float = 1.0, timeout_s: float = 5.0,
                 on_commands: Callable[[list[dict[str, Any]]], None] | None = None, fallback_url: str = ""):
        self.endpoint = f"{url.rstrip('/')}/api/v1/jobs/{job_id}/ingest"
        # ``url`` is the node agent (trainer/agent.py) and this the control plane: a batch the agent does
        # not take (it is down or hung) goes there directly.
        self.fallback = f"{fallback_url.rstrip('/')}/api/v1/jobs/{job_id}/ingest" if fallback_url else ""
        # Through an agent, the sender also asks it for commands half-way through each interval (see
        # trainer/agent.py: a command then waits at most half an interval for this rank).
        self._commands_url = (f"{url.rstrip('/')}/api/v1/jobs/{job_id}/commands"
                              if fallback_url and on_commands is not None else "")
        self.polls = 0
        self.sent_direct = 0
        self._token = token
        self.source, self.rank = source, rank
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self._on_commands = on_commands
        self._node, self._pid = socket.gethostname(), os.getpid()
        self._id_prefix = f"{source.replace(':', '')}-{self._pid}-{uuid.uuid4().hex[:6]}"
        self._seq = 0
        self._seq_lock = threading.Lock()
        self._q: collections.deque[tuple[str, Heartbeat | Event]] = collections.deque()
        self._spool = Spool(os.path.join(spool_dir, source.replace(":", "")))
        # Opt-in journal of every event this process hands to its sender (``make bench-chaos`` compares
        # it with what the control plane stored): one JSON line per event, written by the sender thread.
        journal_dir = os.environ.get("UNBROKEN_REPORTER_JOURNAL_DIR", "")
        self._journal = os.path.join(journal_dir, f"{self._id_prefix}.jsonl") if journal_dir else ""
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.sent_batches = 0
        # An overloaded control plane's Retry-After (429): nothing is sent before this (monotonic), new
        # batches are spooled meanwhile; a random share of it more spreads the retries of many ranks.
        self._hold_until = 0.0
        self._thread = threading.Thread(target=self._run, name=f"reporter-{source}", daemon=True)
        self._thread.start()

    # -- caller side: O(1), no I/O -------------------------------------------------------------------

    def heartbeat(self, *, step: int, phase: str, loss: float | None = None, step_time_s: float | None = None,
                  tokens_per_s: float | None = None, busy_s: float | None = None) -> None:
        self._q.append(("hb", Heartbeat(
            rank=self.rank, step=step, phase=str(phase), at=time.time(), loss=_finite(loss),
            step_time_s=_finite(step_time_s), tokens_per_s=_finite(tokens_per_s), node=self._node, pid=self._pid,
            busy_s=_finite(busy_s))))

    def event(self, kind: EventKind | str, data: dict[str, Any] | None = None, *, rank: int | None = _UNSET,
              at: float | None = None) -> None:
        with self._seq_lock:
            self._seq += 1
            seq = self._seq
        self._q.append(("ev", Event(id=f"{self._id_prefix}-{seq}", kind=str(kind),
                                    at=time.time() if at is None else at,
                                    rank=self.rank if rank is _UNSET else rank, data=_jsonable(data or {}))))
        if kind in _SENT_AT_ONCE:
            self.flush()

    def flush(self) -> None:
        self._wake.set()

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (spooling what cannot be sent) and stop the thread, within ``timeout_s``."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():  # stuck in a request: keep the rest on disk for the next process
            batch = self._drain()
            if batch is not None:
                self._spool.append(batch)

    # -- sender thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        wait_s = self.interval_s / 2 if self._commands_url else self.interval_s
        poll_turn = False
        while True:
            woken = self._wake.wait(wait_s)
            self._wake.clear()
            stopping = self._stop.is_set()
            if self._commands_url and not woken and not stopping:
                poll_turn = not poll_turn  # every other half-interval: ask the agent, send nothing
                if poll_turn:
                    self._poll_commands()
                    continue
            try:
                if not stopping and time.monotonic() < self._hold_until:
                    while (batch := self._drain()) is not None:
                        self._spool.append(batch)
                    continue
                self._replay()
                while (batch := self._drain()) is not None:
                    self._deliver(batch)
            except Exception:  # the reporter must never take the trainer down
                log.exception("reporter: unexpected error (continuing)")
            if stopping:
                return

    def _drain(self) -> dict[str, Any] | None:
        hbs: list[dict[str, Any]] = []
        evs: list[dict[str, Any]] = []
        while self._q and len(hbs) < MAX_HEARTBEATS and len(evs) < MAX_EVENTS:
            kind, item = self._q.popleft()
            (hbs if kind == "hb" else evs).append(as_dict(item))
        if not hbs and not evs:
            return None
        if evs and self._journal:
            try:
                with open(self._journal, "a", encoding="utf-8") as f:
                    f.writelines(json.dumps(e, default=str) + "\n" for e in evs)
            except OSError:
                pass
        return {"v": WIRE_VERSION, "source": self.source, "heartbeats": hbs, "events": evs}

    def _deliver(self, batch: dict[str, Any]) -> None:
        if self._spool.pending():  # keep order: nothing overtakes a spooled batch
            self._spool.append(batch)
            return
        if self._send(batch) == RETRY:
            self._spool.append(batch)

    def _replay(self) -> None:
        for name in self._spool.pending():
            batch = self._spool.load(name)
            if batch is not None and self._send(batch) == RETRY:
                return
            self._spool.remove(name)

    def _poll_commands(self) -> None:
        # S310: the control plane's URL (http(s): TrainConfig.validate) or the node agent's (http://, trainer/agent.py).
        req = urllib.request.Request(self._commands_url, headers={"Authorization": f"Bearer {self._token}"})  # noqa: S310
        try:
            with urllib.request.urlopen(req, timeout=min(self.timeout_s, max(0.2, self.interval_s / 2))) as r:  # noqa: S310
                payload = r.read()
        except Exception:  # noqa: BLE001 - the agent is down or busy: the next post (or the fallback) brings them
            return
        self.polls += 1
        self._offer_commands(payload)

    def _send(self, batch: dict[str, Any]) -> str:
        body = json.dumps({**batch, "sent_at": time.time()}, separators=(",", ":")).encode()
        verdict = self._post(self.endpoint, body)
        if verdict == RETRY and self.fallback and time.monotonic() >= self._hold_until:
            verdict = self._post(self.fallback, body)
            self.sent_direct += verdict == OK
        return verdict

    def _post(self, endpoint: str, body: bytes) -> str:
        verdict, payload, hold_s = post_batch(endpoint, self._token, body, self.timeout_s, who="reporter")
        if hold_s:
            self._hold_until = time.monotonic() + hold_s
        if verdict != OK:
            return verdict
        self.sent_batches += 1
        self._offer_commands(payload)
        return OK

    def _offer_commands(self, payload: bytes | None) -> None:
        """Hand the commands in an answer (a post's or a poll's) to ``on_commands``."""
        if self._on_commands is None:
            return
        try:
            commands = json.loads(payload or b"{}").get("commands") or []
        except (ValueError, AttributeError):
            commands = []
        if commands:
            self._on_commands(commands)


def post_batch(endpoint: str, token: str, body: bytes, timeout_s: float, *, who: str) -> tuple[str, bytes, float]:
    """POST one encoded batch to an ingest endpoint: (OK | RETRY | DROP, the response body, seconds to hold
    off before the next post: a 429's Retry-After with jitter, else 0). A 4xx other than 429 is logged
    (as ``who``) and is DROP: the batch will never be accepted."""
    # S310: the control plane's URL (http(s): TrainConfig.validate) or the node agent's (http://, trainer/agent.py).
    req = urllib.request.Request(endpoint, data=body, method="POST", headers={  # noqa: S310
        "Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310
            return OK, resp.read(), 0.0
    except urllib.error.HTTPError as e:
        if e.code == 429:
            return RETRY, b"", _retry_after_s(e.headers.get("Retry-After"))
        if e.code >= 500:
            return RETRY, b"", 0.0
        detail = e.read()[:2000].decode("utf-8", "replace")
        log.error("%s: control plane refused a batch (HTTP %s), dropping it: %s", who, e.code, detail)
        return DROP, b"", 0.0
    except (OSError, urllib.error.URLError, TimeoutError):
        return RETRY, b"", 0.0


def _retry_after_s(value: str | None, *, cap_s: float = 60.0) -> float:
    """A 429's Retry-After (seconds; an HTTP date or nothing reads as 1 s), plus up to half again at
    random so that ranks shed together do not come back together."""
    try:
        base = min(cap_s, max(0.0, float(value or 1)))
    except ValueError:
        base = 1.0
    return base * (1.0 + 0.5 * random.random())  # noqa: S311 - jitter, not a secret


def _jsonable(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, float):
        return _finite(v)
    if v is None or isinstance(v, (bool, int, str)):
        return str(v) if isinstance(v, str) and type(v) is not str else v  # StrEnum -> plain str
    return str(v)


def make_reporter(*, url: str, job_id: str, token: str, source: str, rank: int | None, spool_dir: str,
                  interval_s: float, on_commands: Callable[[list[dict[str, Any]]], None] | None = None,
                  agent_url: str = "") -> Reporter:
    """The reporter for ``url`` (none without one); through the node agent at ``agent_url`` when set."""
    if not url:
        return NullReporter()
    if agent_url:
        return HttpReporter(url=agent_url, fallback_url=url, job_id=job_id, token=token, source=source, rank=rank,
                            spool_dir=spool_dir, interval_s=interval_s, on_commands=on_commands)
    return HttpReporter(url=url, job_id=job_id, token=token, source=source, rank=rank, spool_dir=spool_dir,
                        interval_s=interval_s, on_commands=on_commands)
