"""Where rank heartbeats go: the one seam between the ingest hot path and the ``Rank`` rows.

Two stores with one interface (``record``, ``flush``, ``overdue``, ``freshest``, ``forget``, ``drop_job``):

- ``DbHeartbeatStore`` (no ``REDIS_URL``): each batch upserts its ranks' rows inside the ingest
  transaction. Rank rows are always current.
- ``RedisHeartbeatStore`` (``REDIS_URL`` set): one Lua call per batch keeps, per job, the newest ``at``
  and state (the beat as JSON) by rank in two hashes, the job's progress (max step, first train beat),
  a global deadline ZSET and a dirty set. ``flush()`` (a Celery task the beat schedule runs every
  ``HEARTBEAT_FLUSH_INTERVAL_S``; the one writer of rows from Redis) upserts the dirty ranks' rows and the
  jobs' progress. The watchdog reads the deadline ZSET, so lost-rank detection does not wait for a flush.

Accepted trade-offs (Redis store):

- ``Rank`` rows and ``Job.last_step/max_step/last_progress_at`` (so the dashboard and stall detection)
  lag Redis by up to one flush interval plus the flush's duration (5 s by default; a 100,000-rank
  flush is ~1 s of CPU, paced to half duty, so ~2 s of wall time, longer under heavy load).
  Heartbeat-lost detection does not lag: the watchdog reads deadlines from Redis and judges a rank by
  its freshest state (``jobs.health``, which the dashboard reads too) before it claims it.
- ``Rank.step_changed_at`` is exact to one flush interval (the flush sees the step change, not the beat
  that made it); stall timeouts are minutes.
- Redis runs without persistence in the reference set-up. If it restarts empty, the flushed rows remain
  and the watchdog's database scan still catches ranks that stop beating; if it is unreachable, ingest
  writes heartbeats to the database instead (``ingestion._record``), and the watchdog uses the rows.

Both stores write rows with the same upsert (``upsert_ranks`` in ``jobs.rank_rows``, with the types and
deadlines it needs), which only ever moves a rank forward in time: a heartbeat older than the stored one
changes nothing.

Isolation: the flush writes per job and, when a slice fails, one rank at a time, each state checked
against the wire module's bounds (``wire.parse_heartbeat``) to name what is wrong. A state that cannot be
written (left in Redis by an older server that accepted unbounded values, or refused by the database)
is quarantined: logged, removed from Redis (only if unchanged), and kept as a ``QuarantinedHeartbeat``
row that ``/metrics`` counts and the job page shows. A job whose flush still fails is logged and stays
dirty; every other job keeps flushing, and the flush never raises out of its loop.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import UTC, datetime
from typing import Protocol

import orjson
from django.conf import settings
from django.db import transaction

from controlplane.jobs.rank_rows import (  # noqa: F401 - the stores' shared types, re-exported
    _TRAIN,
    _UPSERT_TAIL,
    RankState,
    Timeouts,
    beat_dict,
    first_train_at,
    newest_per_rank,
    update_job_progress,
    upsert_ranks,
    utc,
)
from trainer import wire

log = logging.getLogger(__name__)


class HeartbeatStore(Protocol):
    in_transaction: bool  # True: ``record`` must run inside the ingest transaction (it writes rows)

    def record(self, job_id: int, beats: list[dict], timeouts: Timeouts, *, now: datetime) -> None: ...

    def flush(self, *, now: datetime | None = None) -> int: ...

    def overdue(self, now: datetime, *, limit: int = 10000) -> list[tuple[int, int, float]]: ...

    def freshest(self, job_id: int, ranks: list[int]) -> dict[int, RankState]: ...

    def forget(self, entries: list[tuple[int, int, float]]) -> None: ...

    def drop_job(self, job_id: int) -> None: ...


class DbHeartbeatStore:
    """Heartbeats straight into ``Rank`` rows, in the ingest transaction (the embedded default)."""

    in_transaction = True
    backstop_grace_s = 0.0  # the rows are the truth

    def record(self, job_id: int, beats: list[dict], timeouts: Timeouts, *, now: datetime) -> None:
        if not beats:
            return
        states = newest_per_rank(beats).values()
        upsert_ranks(job_id, states, timeouts, now=now)
        # The first train beat from every beat of the batch; the top step still from each rank's newest
        # (the Redis store takes it from every beat).
        first_train = first_train_at([b["at"] for b in beats], [b["phase"] for b in beats])
        update_job_progress(job_id, states, first_train=first_train)

    def flush(self, *, now: datetime | None = None) -> int:
        return 0

    def overdue(self, now: datetime, *, limit: int = 10000) -> list[tuple[int, int, float]]:
        return []  # the watchdog's database scan covers everything

    def freshest(self, job_id: int, ranks: list[int]) -> dict[int, RankState]:
        return {}

    def forget(self, entries: list[tuple[int, int, float]]) -> None:
        pass

    def drop_job(self, job_id: int) -> None:
        pass


# KEYS: 1 the job's state hash (rank -> "<at>|<beat JSON>"), 2 its deadline zset (rank -> deadline),
# 3 its progress hash (max_step, progress_at, first_train_at: every beat counts, not only the newest
# per rank), 4 the set of jobs with unflushed beats, 5 the set of jobs with heartbeat state.
# ARGV: 1 job id, 2 the batch's top step, 3 when it was reached, 4 its earliest train beat ("" = none),
# 5 the beats' ranks, 6 their ``at``s, 7 their deadlines (null = none) and 8 the beats themselves as
# JSON arrays (the script cuts 8 into one object per beat). Eight arguments whatever the batch size:
# packing thousands of small arguments, or one ``orjson.dumps`` per beat (~2.5 us each, against
# ~0.3 us per beat for the whole list), cost the web process more than the script costs Redis.
# A beat is taken only if its ``at`` is later than the stored one (and than an earlier beat of the
# same rank in this batch): heartbeat state only moves forward in time.
_RECORD_LUA = """
local gmatch = string.gmatch
local ranks, ats, dls = {}, {}, {}
local n = 0
for x in gmatch(ARGV[5], '[^,%[%]]+') do n = n + 1; ranks[n] = x end
local i = 0
for x in gmatch(ARGV[6], '[^,%[%]]+') do i = i + 1; ats[i] = x end
i = 0
for x in gmatch(ARGV[7], '[^,%[%]]+') do i = i + 1; dls[i] = x end
if ARGV[2] ~= '' then
  local cur = redis.call('HGET', KEYS[3], 'max_step')
  if not cur or tonumber(ARGV[2]) > tonumber(cur) then
    redis.call('HSET', KEYS[3], 'max_step', ARGV[2], 'progress_at', ARGV[3])
  end
end
if ARGV[4] ~= '' then
  local f = redis.call('HGET', KEYS[3], 'first_train_at')
  if not f or tonumber(ARGV[4]) < tonumber(f) then redis.call('HSET', KEYS[3], 'first_train_at', ARGV[4]) end
end
local best = {}
local find, sub = string.find, string.sub
for i = 1, n, 4000 do
  local part = redis.call('HMGET', KEYS[1], unpack(ranks, i, math.min(i + 3999, n)))
  for j = 1, #part do
    local v = part[j]
    local k = v and find(v, '|', 1, true)
    if k then best[ranks[i + j - 1]] = tonumber(sub(v, 1, k - 1)) end
  end
end
local states, zadd, zrem = {}, {}, {}
local blob = ARGV[8]
local pos, stop = 2, #blob - 1  -- inside the array's brackets
for j = 1, n do
  -- Beats are flat objects; inside a JSON string a quote is always escaped, so the bytes },{" occur
  -- only between two beats.
  local s = find(blob, '},{"', pos, true)
  local line = sub(blob, pos, s or stop)
  pos = (s or stop) + 2
  local rank, at = ranks[j], tonumber(ats[j])
  local prev = best[rank]
  if prev == nil or at > prev then
    best[rank] = at
    states[#states + 1] = rank
    states[#states + 1] = ats[j] .. '|' .. line
    local d = dls[j]
    if d == 'null' then
      zrem[#zrem + 1] = rank
    else
      zadd[#zadd + 1] = d
      zadd[#zadd + 1] = rank
    end
  end
end
for i = 1, #states, 4000 do redis.call('HSET', KEYS[1], unpack(states, i, math.min(i + 3999, #states))) end
for i = 1, #zadd, 4000 do redis.call('ZADD', KEYS[2], unpack(zadd, i, math.min(i + 3999, #zadd))) end
for i = 1, #zrem, 4000 do redis.call('ZREM', KEYS[2], unpack(zrem, i, math.min(i + 3999, #zrem))) end
if #states > 0 then
  redis.call('SADD', KEYS[4], ARGV[1])
  redis.call('SADD', KEYS[5], ARGV[1])
  for k = 1, 3 do redis.call('EXPIRE', KEYS[k], 604800) end  -- a forgotten job's state goes after a week
end
return #states / 2
"""

# Take the dirty set for flushing, unless an earlier flush died half-way (then finish that one first).
_TAKE_DIRTY_LUA = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 1 end
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('RENAME', KEYS[1], KEYS[2])
return 1
"""

# Remove deadline entries only if no newer heartbeat moved them since the watchdog read them.
_FORGET_LUA = """
local n = 0
for i = 1, #ARGV, 2 do
  local s = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if s and tonumber(s) <= tonumber(ARGV[i + 1]) then
    n = n + redis.call('ZREM', KEYS[1], ARGV[i])
  end
end
return n
"""


# Remove a rank's state (and its deadline) only if it still holds what the flush read.
_DROP_IF_SAME_LUA = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
  return 1
end
return 0
"""


def _keep_newest(into: dict[int, RankState], st: RankState) -> None:
    prev = into.get(st.rank)
    if prev is None or st.at > prev.at:
        into[st.rank] = st


# States read back from Redis: storable values only (the ingest window does not apply: a rank's
# state may rightly be older than it; a state from beyond tomorrow was never a real clock reading).
def _stored_window(world_size: int | None = None) -> wire.Window:
    return wire.Window(earliest=0.0, latest=time.time() + 86400.0, world_size=world_size)


def _state(raw: bytes, window: wire.Window | None = None) -> RankState:
    """A stored state, checked against the wire bounds; raises ``ValueError`` (a ``WireError`` naming
    the field, or a JSON error) when it cannot be written to a ``Rank`` row."""
    try:
        d = orjson.loads(raw[raw.find(b"|") + 1:])
        h = wire.parse_heartbeat(d, "state", window or _stored_window())
    except TypeError as e:  # an unhashable value where a vocabulary word belongs
        raise ValueError(f"state: {e}") from e
    return RankState.of(beat_dict(h))


def _state_unchecked(raw: bytes) -> RankState:
    """A stored state as written by this server's ingest (already within the wire bounds)."""
    return RankState.of(orjson.loads(raw[raw.find(b"|") + 1:]))


def _why_unstorable(raw: bytes, window: wire.Window) -> str:
    try:
        _state(raw, window)
    except ValueError as e:
        return str(e)
    return "state: not a heartbeat state"


def _printable(raw: bytes | str, limit: int) -> str:
    """Text a Postgres text column can hold (NULs escaped), truncated."""
    text = raw.decode("utf-8", "backslashreplace") if isinstance(raw, bytes) else raw
    return text.replace("\x00", "\\x00")[:limit]


def record_quarantine(job_id: int, rank: int | None, reason: str, payload: bytes | str, *, now: datetime) -> None:
    """Keep (count) a state the flush could not write, at most ``QuarantinedHeartbeat.PER_JOB`` rows per
    job (further ranks are counted on the job's ``rank=None`` row). Never raises: logged instead."""
    from django.db.models import F

    from controlplane.jobs.models import QuarantinedHeartbeat as Q

    reason, text = _printable(reason, 1000), _printable(payload, 2000)
    try:
        with transaction.atomic():
            fields = {"reason": reason, "payload": text, "at": now, "count": F("count") + 1}
            if Q.objects.filter(job_id=job_id, rank=rank).update(**fields):
                return
            if rank is not None and Q.objects.filter(job_id=job_id).count() >= Q.PER_JOB:
                rank = None
                if Q.objects.filter(job_id=job_id, rank=None).update(**fields):
                    return
            Q.objects.create(job_id=job_id, rank=rank, reason=reason, payload=text, at=now)
    except Exception:  # noqa: BLE001 - the log line is the record then
        log.exception("heartbeat flush: could not store the quarantine of job %s rank %s", job_id, rank)


class RedisHeartbeatStore:
    """Heartbeats in Redis; ``Rank`` rows updated by ``flush()`` (see the module docstring).

    Keys (``prefix`` = ``ubk:hb``): ``job:<id>:state`` (hash), ``job:<id>:deadlines`` (zset),
    ``job:<id>:progress`` (hash), ``jobs`` (set: jobs with state), ``dirty``/``flushing`` (sets of job ids).
    """

    in_transaction = False

    @property
    def backstop_grace_s(self) -> float:
        """How far behind their deadline rows must be before the watchdog's database scan looks at
        them (the rows lag Redis by up to a flush; Redis's own index has no such delay)."""
        return 2 * flush_interval_s() + 5.0

    def __init__(self, url: str, *, prefix: str = "ubk:hb"):
        import redis

        self.redis = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2,
                                          health_check_interval=30)
        self.prefix = prefix
        self.JOBS = f"{prefix}:jobs"
        self.DIRTY = f"{prefix}:dirty"
        self.FLUSHING = f"{prefix}:flushing"
        self.FLUSH_LOCK = f"{prefix}:flush-lock"
        self._record = self.redis.register_script(_RECORD_LUA)
        self._take = self.redis.register_script(_TAKE_DIRTY_LUA)
        self._forget = self.redis.register_script(_FORGET_LUA)
        self._drop_if_same = self.redis.register_script(_DROP_IF_SAME_LUA)

    def keys(self, job_id: int) -> tuple[str, str, str]:
        """The job's state hash, deadline zset and progress hash."""
        base = f"{self.prefix}:job:{job_id}"
        return f"{base}:state", f"{base}:deadlines", f"{base}:progress"

    def progress(self, job_id: int) -> tuple[tuple[int, float] | None, float | None]:
        """((max step, when reached), earliest train beat) over every beat Redis took for the job."""
        raw = self.redis.hgetall(self.keys(job_id)[2])
        top = (int(raw[b"max_step"]), float(raw[b"progress_at"])) if b"max_step" in raw else None
        first = float(raw[b"first_train_at"]) if b"first_train_at" in raw else None
        return top, first

    def record(self, job_id: int, beats: list[dict], timeouts: Timeouts, *, now: datetime) -> None:
        """One Lua call: the script keeps only beats newer than the stored ones (atomically)."""
        if not beats:
            return
        # Column-wise (comprehensions and orjson run at C speed; this is the ingest hot path).
        ranks = [b["rank"] for b in beats]
        ats = [b["at"] for b in beats]
        phases = [b["phase"] for b in beats]
        steps = [b["step"] for b in beats]
        deadlines = timeouts.deadlines(phases, ats)
        top_step = max(steps)
        top_at = min(a for a, st in zip(ats, steps, strict=True) if st == top_step)
        first_train = first_train_at(ats, phases)
        dumps = orjson.dumps
        self._record(keys=[*self.keys(job_id), self.DIRTY, self.JOBS],
                     args=[job_id, top_step, top_at, "" if first_train is None else first_train, dumps(ranks),
                           dumps(ats), dumps(deadlines), dumps(beats)])

    def flush(self, *, now: datetime | None = None) -> int:
        """Write the newest states of jobs with new beats into ``Rank`` rows and the jobs' progress.

        1. Take a lock (one flusher at a time; it expires if this process dies).
        2. Atomically rename the dirty set to the flushing set (or resume a flushing set left by a
           flusher that died: the rows only move forward, so writing twice is harmless).
        3. Per job, read the ranks' states a slice at a time (HSCAN) and upsert each slice in its own
           transaction (a rank whose beat is not newer than its row is skipped by the upsert's WHERE);
           then fold the job's progress. Between slices the flusher pauses as long as the slice took
           (``FLUSH_DUTY``): a 100k-rank flush is ~1 s of CPU, and spent in one burst it doubled the
           ingest p99 on a 2-core machine. A state that cannot be written is quarantined (see the
           module docstring); a job that fails anyway is logged and put back in the dirty set.
        4. Delete the flushing set only after the commits; a crash before that repeats step 3.
        """
        from controlplane.jobs.models import Job

        now = now or datetime.now(tz=UTC)
        token = str(time.time())
        if not self.redis.set(self.FLUSH_LOCK, token, nx=True, px=60_000):
            return 0
        try:
            if not self._take(keys=[self.DIRTY, self.FLUSHING]):
                return 0
            job_ids = [int(j) for j in self.redis.smembers(self.FLUSHING)]
            jobs = {j.pk: j for j in Job.objects.filter(pk__in=job_ids).only("pk", "spec")}
            n = 0
            failed = []
            for job_id in job_ids:
                try:
                    if job_id not in jobs:
                        self.drop_job(job_id)
                        continue
                    job = jobs[job_id]
                    n += self._flush_job(job_id, job.timeouts, now, token, world_size=job.world_size)
                except Exception:  # one job's failure must not hold up any other job's rows
                    log.exception("heartbeat flush: job %s failed; it is retried by the next flush", job_id)
                    failed.append(job_id)
                self._extend_lock(token)
            if failed:
                self.redis.sadd(self.DIRTY, *failed)
            self.redis.delete(self.FLUSHING)
            return n
        finally:
            # Release only our own lock.
            if self.redis.get(self.FLUSH_LOCK) == token.encode():
                self.redis.delete(self.FLUSH_LOCK)

    FLUSH_SLICE = 5000  # ranks per HSCAN step and per upsert transaction
    FLUSH_DUTY = 0.5  # the flusher's share of its wall time spent working, between slices

    def _extend_lock(self, token: str) -> None:
        if self.redis.get(self.FLUSH_LOCK) == token.encode():
            self.redis.pexpire(self.FLUSH_LOCK, 60_000)  # still ours, still working

    def _flush_job(self, job_id: int, timeouts: Timeouts, now: datetime, token: str, *,
                   world_size: int | None = None) -> int:
        key = self.keys(job_id)[0]
        window = _stored_window(world_size)
        newest: dict[int, RankState] = {}  # every rank's newest state seen (for the job's progress)
        cursor, n = 0, 0
        while True:
            t0 = time.monotonic()
            cursor, part = self.redis.hscan(key, cursor, count=self.FLUSH_SLICE)
            states: dict[int, RankState] = {}  # HSCAN may return a field twice: the newest wins
            raws: dict[int, tuple[bytes, bytes]] = {}
            for field, raw in part.items():
                try:
                    # Ingest bounded every value already: the full wire check runs only when a slice
                    # fails (it cost the ingest p99 ~2x at 50k beats/s when it ran on every state).
                    st = _state_unchecked(raw)
                except (ValueError, KeyError, TypeError):
                    self.quarantine(job_id, field, raw, _why_unstorable(raw, window), now=now)
                    continue
                _keep_newest(states, st)
                if states[st.rank] is st:
                    raws[st.rank] = (field, raw)
            try:
                with transaction.atomic():
                    n += upsert_ranks(job_id, states.values(), timeouts, now=now)
            except Exception as e:  # noqa: BLE001 - find the rows that cannot be written, write the others
                log.warning("heartbeat flush: job %s: a slice failed (%s); checking its ranks one by one", job_id, e)
                for st in list(states.values()):
                    field, raw = raws[st.rank]
                    try:
                        st = _state(raw, window)
                        with transaction.atomic():
                            n += upsert_ranks(job_id, [st], timeouts, now=now)
                    except ValueError as e1:  # the wire bounds name the field
                        self.quarantine(job_id, field, raw, str(e1), now=now)
                        del states[st.rank]
                    except Exception as e1:  # noqa: BLE001
                        self.quarantine(job_id, field, raw, f"the database refused it: {e1}", now=now)
                        del states[st.rank]
            for st in states.values():
                _keep_newest(newest, st)
            if cursor == 0:
                break
            self._extend_lock(token)
            time.sleep((time.monotonic() - t0) * (1 - self.FLUSH_DUTY) / self.FLUSH_DUTY)
        top, first_train = self._checked_progress(job_id, window, now)
        update_job_progress(job_id, newest.values(), top=top, first_train=first_train)
        return n

    def quarantine(self, job_id: int, field: bytes, raw: bytes, reason: str, *, now: datetime) -> None:
        """Take a state that cannot be written out of Redis (unless a newer beat replaced it since it
        was read) and keep it, with the reason, as a ``QuarantinedHeartbeat``."""
        rank = int(field) if field.isdigit() and int(field) <= wire.MAX_RANK else None
        log.warning("heartbeat flush: quarantined job %s rank %s: %s", job_id, rank, _printable(reason, 300))
        try:
            self._drop_if_same(keys=list(self.keys(job_id)[:2]), args=[field, raw])
        except Exception:  # noqa: BLE001 - the next flush quarantines it again
            log.warning("heartbeat flush: could not remove job %s rank %s's state", job_id, rank, exc_info=True)
        record_quarantine(job_id, rank, reason, raw, now=now)

    def _checked_progress(self, job_id: int, window: wire.Window, now: datetime
                          ) -> tuple[tuple[int, float] | None, float | None]:
        """``progress()``, with values that cannot be stored quarantined (rank None) and removed."""
        key = self.keys(job_id)[2]
        raw = self.redis.hgetall(key)
        top = first = None
        try:
            if b"max_step" in raw:
                step, at = int(raw[b"max_step"]), float(raw[b"progress_at"])
                if not 0 <= step <= wire.MAX_STEP:
                    raise ValueError(f"progress: max_step {step} is outside 0..{wire.MAX_STEP}")
                top = (step, window.check(at, "progress.progress_at"))
            if b"first_train_at" in raw:
                first = window.check(float(raw[b"first_train_at"]), "progress.first_train_at")
        except (ValueError, KeyError) as e:
            log.warning("heartbeat flush: quarantined job %s's progress: %s", job_id, e)
            self.redis.delete(key)
            record_quarantine(job_id, None, str(e), repr(raw), now=now)
            return None, None
        return top, first

    def overdue(self, now: datetime, *, limit: int = 10000) -> list[tuple[int, int, float]]:
        """(job_id, rank, deadline) of every rank whose deadline passed."""
        job_ids = sorted(int(j) for j in self.redis.smembers(self.JOBS))
        pipe = self.redis.pipeline(transaction=False)
        for j in job_ids:
            pipe.zrangebyscore(self.keys(j)[1], "-inf", now.timestamp(), start=0, num=limit, withscores=True)
        out = []
        for j, rows in zip(job_ids, pipe.execute(), strict=True):
            out += [(j, int(r), float(score)) for r, score in rows]
        return out

    def freshest(self, job_id: int, ranks: list[int]) -> dict[int, RankState]:
        out: dict[int, RankState] = {}
        key = self.keys(job_id)[0]
        for i in range(0, len(ranks), 5000):
            for raw in self.redis.hmget(key, ranks[i:i + 5000]):
                if raw is None:
                    continue
                try:
                    st = _state(raw)
                except ValueError:  # cannot be written: the flush quarantines it; judge by the row
                    continue
                out[st.rank] = st
        return out

    def forget(self, entries: list[tuple[int, int, float]]) -> None:
        by_job: dict[int, list] = {}
        for j, r, score in entries:
            by_job.setdefault(j, []).extend((r, repr(score)))
        for j, args in by_job.items():
            for i in range(0, len(args), 4000):
                self._forget(keys=[self.keys(j)[1]], args=args[i:i + 4000])

    def drop_job(self, job_id: int) -> None:
        """Forget a job's heartbeat state (it finished or was deleted)."""
        self.redis.unlink(*self.keys(job_id))  # freed in the background: a big hash must not block Redis
        self.redis.srem(self.JOBS, job_id)


_store: HeartbeatStore | None = None
_store_lock = threading.Lock()


def get_store() -> HeartbeatStore:
    """The process's store: Redis when ``REDIS_URL`` is set, else the database."""
    global _store
    if _store is None:
        with _store_lock:
            if _store is None:
                url = getattr(settings, "REDIS_URL", "")
                _store = RedisHeartbeatStore(url) if url else DbHeartbeatStore()
    return _store


def set_store(store: HeartbeatStore | None) -> None:
    """Replace the process's store (tests; ``None`` = choose again from settings)."""
    global _store
    _store = store


def flush_interval_s() -> float:
    return float(getattr(settings, "HEARTBEAT_FLUSH_INTERVAL_S", 5.0))


__all__ = ["DbHeartbeatStore", "HeartbeatStore", "RankState", "RedisHeartbeatStore", "Timeouts", "get_store",
           "newest_per_rank", "set_store", "update_job_progress", "upsert_ranks", "utc"]
