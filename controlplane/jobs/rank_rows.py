"""Rank rows: the one upsert both heartbeat stores write with, and what it needs.

A heartbeat's newest state per rank (``RankState``), the phase-aware deadline (``Timeouts.deadline``) and
``upsert_ranks``, which only ever moves a rank forward in time (a heartbeat older than the stored one
changes nothing); ``update_job_progress`` moves the job's step and progress clock. ``jobs.heartbeats`` has
the stores that call these; ``jobs.rank_health`` judges a rank by the same rules.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any, Iterable

from django.db import connection

from controlplane.jobs.spec import Timeouts
from trainer import wire
from trainer.wire import Heartbeat, Phase

_STOPPED = Phase.STOPPED.value
_TRAIN = Phase.TRAIN.value
_SLOW_PHASES = frozenset(p.value for p in wire.SLOW_PHASES)


def utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


def _rank_state_fields() -> list:
    return [(f.name, f.type, dataclasses.field(default=f.default)) if f.default is not dataclasses.MISSING
            else (f.name, f.type) for f in dataclasses.fields(Heartbeat)]


# A rank's newest heartbeat plus since when its step held: the wire heartbeat's fields (one definition,
# ``trainer.wire.Heartbeat``), mutable, and ``step_since``, the earliest ``at`` of the current run of beats
# with this step (as far as known; unix seconds).
RankState = dataclasses.make_dataclass(
    "RankState", [*_rank_state_fields(), ("step_since", float, dataclasses.field(default=0.0))],
    slots=True, namespace={"of": classmethod(lambda cls, b, step_since=None: _rank_state(cls, b, step_since))})
RankState.__module__ = __name__


def _rank_state(cls: type, b: dict, step_since: float | None) -> Any:
    """``RankState.of``: from a beat dict (the wire heartbeat's fields; optional ones may be missing)."""
    st = cls(**b)
    st.at = at = float(st.at)
    st.step_since = at if step_since is None else step_since
    return st


def beat_dict(hb: Heartbeat) -> dict:
    return wire.as_dict(hb)


def newest_per_rank(beats: Iterable[dict]) -> dict[int, RankState]:
    """Collapse beats to each rank's newest, remembering since when its step held.

    Out-of-order beats inside a batch are placed by their own ``at``.
    """
    newest: dict[int, dict] = {}
    dups: dict[int, list[dict]] | None = None
    for b in beats:
        r = b["rank"]
        prev = newest.get(r)
        if prev is None:
            newest[r] = b
            continue
        if dups is None:
            dups = {}
        dups.setdefault(r, [prev]).append(b)
        if b["at"] > prev["at"]:
            newest[r] = b
    out = {r: RankState.of(b) for r, b in newest.items()}
    if dups:
        for r, group in dups.items():
            group.sort(key=lambda b: b["at"])
            last = group[-1]
            since = last["at"]
            for b in reversed(group):
                if b["step"] != last["step"]:
                    break
                since = b["at"]
            out[r].step_since = float(since)
    return out


# --- the shared upsert -------------------------------------------------------------------------------

_RANK_COLUMNS = ("job_id", "rank", "node", "pid", "phase", "last_heartbeat_at", "last_step", "step_changed_at",
                 "loss", "step_time_s", "tokens_per_s", "stale_at", "stall_at", "busy_s")
# Only newer heartbeats update a row. The step clock keeps its start while the step holds. A claim is
# cleared when the new heartbeat shows life (its deadline is in the future: a late replay of an old beat
# does not revive a lost rank) or progress (the step moved).
_UPSERT_TAIL = """
ON CONFLICT (job_id, rank) DO UPDATE SET
  node = excluded.node, pid = excluded.pid, phase = excluded.phase,
  last_heartbeat_at = excluded.last_heartbeat_at, loss = excluded.loss,
  step_time_s = excluded.step_time_s, tokens_per_s = excluded.tokens_per_s, stale_at = excluded.stale_at,
  busy_s = excluded.busy_s,
  step_changed_at = CASE WHEN jobs_rank.last_step = excluded.last_step AND jobs_rank.step_changed_at IS NOT NULL
                         THEN jobs_rank.step_changed_at ELSE excluded.step_changed_at END,
  stall_at = CASE WHEN excluded.stall_at IS NULL THEN NULL
                  WHEN jobs_rank.last_step = excluded.last_step AND jobs_rank.stall_at IS NOT NULL
                  THEN jobs_rank.stall_at ELSE excluded.stall_at END,
  lost_at = CASE WHEN excluded.stale_at IS NULL OR excluded.stale_at > %s THEN NULL ELSE jobs_rank.lost_at END,
  stalled_at = CASE WHEN jobs_rank.last_step <> excluded.last_step THEN NULL ELSE jobs_rank.stalled_at END,
  last_step = excluded.last_step
WHERE jobs_rank.last_heartbeat_at IS NULL OR jobs_rank.last_heartbeat_at < excluded.last_heartbeat_at
"""


def upsert_ranks(job_id: int, states: Iterable[RankState], timeouts: Timeouts, *, now: datetime) -> int:
    """Create or move forward the ``Rank`` rows of ``states``; sorted by rank so that concurrent
    writers lock rows in the same order (no deadlocks). Returns the number of states written.

    Postgres gets 13 array parameters unnested server-side (a VALUES list of 65k rows would spend
    seconds in the driver's placeholder handling); SQLite gets a VALUES list.
    """
    rows = sorted(states, key=lambda s: s.rank)
    if not rows:
        return 0
    if connection.vendor == "postgresql":
        _upsert_pg(job_id, rows, timeouts, now)
    else:
        _upsert_values(job_id, rows, timeouts, now)
    return len(rows)


def _upsert_pg(job_id: int, rows: list[RankState], timeouts: Timeouts, now: datetime) -> None:
    # S608: the SQL is built from constants (_RANK_COLUMNS, _UPSERT_TAIL); the values are parameters.
    sql = (f"INSERT INTO jobs_rank ({', '.join(_RANK_COLUMNS)}) "  # noqa: S608
           "SELECT %b, r, n, p, ph, to_timestamp(a), s, to_timestamp(sc), l, st, tp, to_timestamp(d), to_timestamp(sa), "
           "bz FROM unnest(%b::int[], %b::text[], %b::int[], %b::text[], %b::float8[], %b::int[], %b::float8[], "
           "%b::float8[], %b::float8[], %b::float8[], %b::float8[], %b::float8[], %b::float8[]) "
           "AS t(r, n, p, ph, a, s, sc, l, st, tp, d, sa, bz)" + _UPSERT_TAIL.replace("%s", "%b"))
    stall_s = timeouts.stall_s
    connection.ensure_connection()
    # psycopg's own server-side-binding cursor on Django's connection (same transaction): lists go as
    # binary arrays, not quoted text.
    import psycopg

    with psycopg.Cursor(connection.connection) as cur:
        for i in range(0, len(rows), 10000):
            part = rows[i:i + 10000]
            cols: list[list] = [[] for _ in range(13)]
            (r_, n_, p_, ph_, a_, s_, sc_, l_, st_, tp_, d_, sa_, bz_) = cols
            for x in part:
                r_.append(x.rank)
                n_.append(x.node)
                p_.append(x.pid)
                ph_.append(x.phase)
                a_.append(x.at)
                s_.append(x.step)
                sc_.append(x.step_since)
                l_.append(x.loss)
                st_.append(x.step_time_s)
                tp_.append(x.tokens_per_s)
                d_.append(timeouts.deadline(x.phase, x.at))
                sa_.append(x.step_since + stall_s if x.phase == _TRAIN else None)
                bz_.append(x.busy_s)
            cur.execute(sql, [job_id, *cols, now])


def _upsert_values(job_id: int, rows: list[RankState], timeouts: Timeouts, now: datetime) -> None:
    adapt = connection.ops.adapt_datetimefield_value
    head = f"INSERT INTO jobs_rank ({', '.join(_RANK_COLUMNS)}) VALUES "  # noqa: S608 - constant columns
    one = "(" + ", ".join(["%s"] * len(_RANK_COLUMNS)) + ")"
    now_p = adapt(now)
    stall_s = timeouts.stall_s
    with connection.cursor() as cur:
        for i in range(0, len(rows), 1500):  # SQLite allows 32766 variables per statement
            part = rows[i:i + 1500]
            params: list = []
            for s in part:
                deadline = timeouts.deadline(s.phase, s.at)
                params += (job_id, s.rank, s.node, s.pid, s.phase, adapt(utc(s.at)), s.step,
                           adapt(utc(s.step_since)), s.loss, s.step_time_s, s.tokens_per_s,
                           None if deadline is None else adapt(utc(deadline)),
                           adapt(utc(s.step_since + stall_s)) if s.phase == _TRAIN else None, s.busy_s)
            params.append(now_p)
            cur.execute(head + ", ".join([one] * len(part)) + _UPSERT_TAIL, params)


# A job's current step is the highest its ranks beat within this long of the newest beat (ranks a step
# apart, or one rank behind after a rollback, read as one step).
LIVE_WINDOW_S = 5.0


def first_train_at(ats: list[float], phases: list[str]) -> float | None:
    """The earliest train beat of a batch, over every beat in it (not only each rank's newest); None:
    no train beat. Both heartbeat stores fold it into the job's ``first_step_at``."""
    return min((a for a, p in zip(ats, phases, strict=True) if p == _TRAIN), default=None)


def update_job_progress(job_id: int, states: Iterable[RankState], *, top: tuple[int, float] | None = None,
                        first_train: float | None = None) -> None:
    """Fold ranks' newest states into the job's progress facts with one conditional UPDATE.

    ``max_step`` only grows and ``last_progress_at`` is when it last grew; ``last_step`` follows the
    newest beats (it goes down after a rollback) unless they are older than the last progress
    (a late replay); ``first_step_at`` is the earliest train beat ever seen.
    """
    from django.db.models import Case, F, Q, Value, When

    from controlplane.jobs.models import Job

    states = list(states)
    if not states:
        return
    if top is None:
        best = max(states, key=lambda s: (s.step, -s.at))
        top = (best.step, best.at)
    newest = max(states, key=lambda s: s.at)
    train = [s.at for s in states if s.phase == _TRAIN]
    if first_train is not None:
        train.append(first_train)
    top_step, top_at, newest_at = top[0], utc(top[1]), utc(newest.at)
    last_step = max(s.step for s in states if s.at >= newest.at - LIVE_WINDOW_S)
    fields = {
        "max_step": Case(When(max_step__lt=top_step, then=Value(top_step)), default=F("max_step")),
        "last_progress_at": Case(When(max_step__lt=top_step, then=Value(top_at)), default=F("last_progress_at")),
        "last_step": Case(When(Q(last_progress_at__isnull=True) | Q(last_progress_at__lte=newest_at),
                               then=Value(last_step)), default=F("last_step")),
    }
    if train:
        first = utc(min(train))
        fields["first_step_at"] = Case(When(Q(first_step_at__isnull=True) | Q(first_step_at__gt=first),
                                            then=Value(first)), default=F("first_step_at"))
    Job.objects.filter(pk=job_id).update(**fields)


# --- the stores -----------------------------------------------------------------------------------------
