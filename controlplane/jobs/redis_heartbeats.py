"""The Redis heartbeat store (``REDIS_URL`` set): heartbeats in Redis, ``Rank`` rows written by a flush.

One Lua call per batch keeps, per job, the newest ``at`` and state (the beat as JSON) by rank in two
hashes, the job's progress (max step, first train beat), a global deadline ZSET and a dirty set.
``flush()`` (a Celery task the beat schedule runs every ``HEARTBEAT_FLUSH_INTERVAL_S``; the one writer of
rows from Redis) upserts the dirty ranks' rows and the jobs' progress. The watchdog reads the deadline
ZSET, so lost-rank detection does not wait for a flush.

Accepted trade-offs:

- ``Rank`` rows and ``Job.last_step/max_step/last_progress_at`` (so stall detection and the dashboard's
  tables) lag Redis by up to one flush interval plus the flush's duration (5 s by default; a 100,000-rank
  flush is ~1 s of CPU, paced to half duty, so ~2 s of wall time, longer under heavy load).
  A running job's step on its page and in the API does not lag: ``live_step`` reads it from the
  progress hash. Heartbeat-lost detection does not lag either: the watchdog reads deadlines from Redis
  and judges a rank by its freshest state (``jobs.rank_health``, which the dashboard reads too) before it
  claims it.
- ``Rank.step_changed_at`` is exact to one flush interval (the flush sees the step change, not the beat
  that made it); stall timeouts are minutes.
- Redis runs without persistence in the reference set-up. If it restarts empty, the flushed rows remain
  and the watchdog's database scan still catches ranks that stop beating; if it is unreachable, ingest
  writes heartbeats to the database instead (``ingestion._record``), and the watchdog uses the rows.

Isolation: the flush writes per job and, when a slice fails, one rank at a time; a state that cannot be
written is quarantined (``jobs.heartbeat_quarantine``). A job whose flush still fails is logged and stays
dirty; every other job keeps flushing, and the flush never raises out of its loop.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime

import orjson
from django.conf import settings
from django.db import transaction

from controlplane.jobs.heartbeat_quarantine import (
    checked_state,
    printable,
    record_quarantine,
    stored_window,
    unchecked_state,
    why_unstorable,
)
from controlplane.jobs.rank_rows import (
    LIVE_WINDOW_S,
    RankState,
    Timeouts,
    first_train_at,
    update_job_progress,
    upsert_ranks,
)
from trainer import wire

log = logging.getLogger(__name__)


# KEYS: 1 the job's state hash (rank -> "<at>|<beat JSON>"), 2 its deadline zset (rank -> deadline),
# 3 its progress hash (max_step, progress_at, first_train_at: every beat counts, not only the newest
# per rank), 4 the set of jobs with unflushed beats, 5 the set of jobs with heartbeat state.
# ARGV: 1 job id, 2 the batch's top step, 3 when it was reached, 4 its earliest train beat ("" = none),
# 5 the beats' ranks, 6 their ``at``s, 7 their deadlines (null = none) and 8 the beats themselves as
# JSON arrays (the script cuts 8 into one object per beat), 9 the batch's newest ``at`` and 10 the step
# it shows (``live_step``: the job's current step before a flush writes it). Ten arguments whatever the
# batch size:
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
local la = redis.call('HGET', KEYS[3], 'last_at')
if not la or tonumber(ARGV[9]) >= tonumber(la) then
  redis.call('HSET', KEYS[3], 'last_step', ARGV[10], 'last_at', ARGV[9])
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
        newest_at = max(ats)
        shown = max(st for a, st in zip(ats, steps, strict=True) if a >= newest_at - LIVE_WINDOW_S)
        dumps = orjson.dumps
        self._record(keys=[*self.keys(job_id), self.DIRTY, self.JOBS],
                     args=[job_id, top_step, top_at, "" if first_train is None else first_train, dumps(ranks),
                           dumps(ats), dumps(deadlines), dumps(beats), newest_at, shown])

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
        window = stored_window(world_size)
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
                    st = unchecked_state(raw)
                except (ValueError, KeyError, TypeError):
                    self.quarantine(job_id, field, raw, why_unstorable(raw, window), now=now)
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
                        st = checked_state(raw, window)
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
        log.warning("heartbeat flush: quarantined job %s rank %s: %s", job_id, rank, printable(reason, 300))
        try:
            self._drop_if_same(keys=list(self.keys(job_id)[:2]), args=[field, raw])
        except Exception:  # the next flush quarantines it again
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

    def live_step(self, job_id: int) -> int | None:
        """The job's current step as of its newest beat (the highest step beaten within
        ``LIVE_WINDOW_S`` of it, as the flush folds it into ``Job.last_step``); None before any beat."""
        raw = self.redis.hget(self.keys(job_id)[2], "last_step")
        step = int(raw) if raw is not None else None
        return step if step is not None and 0 <= step <= wire.MAX_STEP else None

    def freshest(self, job_id: int, ranks: list[int]) -> dict[int, RankState]:
        out: dict[int, RankState] = {}
        key = self.keys(job_id)[0]
        for i in range(0, len(ranks), 5000):
            for raw in self.redis.hmget(key, ranks[i:i + 5000]):
                if raw is None:
                    continue
                try:
                    st = checked_state(raw)
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


def flush_interval_s() -> float:
    return float(getattr(settings, "HEARTBEAT_FLUSH_INTERVAL_S", 5.0))
