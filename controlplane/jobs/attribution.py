"""Which fault of a failure is its cause, which are its echoes, and which failures repeat.

One failure makes several faults: a rank is killed (a signal, an OOM kill, a lost node) and every peer
then fails in gloo or NCCL ("connection reset by peer", a collective timeout); ft_launcher stops the rest
(SIGTERM); an in-process restart that the kill cut short and the in-job restart that finished it both
report it. The faults of one failure are an **episode**: those of one restart cycle (an in-process cycle
that handed on to a later one belongs to that one) and, for faults of no cycle, those within
``EPISODE_S`` of another member. In each episode one fault is the **primary**, the one with the
strongest evidence of being a cause (``weight``: a rank killed by a signal other than a stop, a rank
whose exception is not a communication error, a Kubernetes container state, a rank that hung), the
earliest of equals; the others are its **consequences**. Arrival order decides nothing: every fault that
arrives re-runs ``attribute`` for the faults around it, so a killed rank's exit, seen after its peers'
exceptions, takes the primary over.

Then, along the job's primaries in time order, a primary identical to the one before it (same class,
exception type and innermost user frame; or the same signal or exit code) with no step progress between
them is a **repeat** of the first of the run: one failure, counted (``Fault.count``), each time kept.

Writes only what changed (``attributed_at`` marks when a fault's attribution last moved).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import transaction
from django.utils import timezone

from controlplane.jobs import evidence
from controlplane.jobs.models import Event, Fault, Job
from trainer.stacks import COLLECTIVE_FRAME
from trainer.wire import FaultClass

EPISODE_S = 15.0  # faults of no cycle this close to a member belong to its failure
REPEAT_LOOKBACK = timedelta(hours=1)  # how far back a repeat looks for the run's first occurrence
MAX_FAULTS = 2000  # faults one pass reads (the newest of its window)

# An error a rank raises because a peer went away (or its collective timed out): an echo, not a cause.
COMM_ERROR = re.compile(
    r"gloo|nccl|connection (?:reset|closed|refused|aborted)|reset by peer|closed by peer|broken pipe|"
    r"DistNetworkError|DistBackendError|DistStoreError|ProcessGroup(?:Gloo|NCCL)|"
    r"collective operation timeout|Socket ?Timeout|timed out waiting for|watchdog caught collective", re.I)
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")
WAITING = COLLECTIVE_FRAME  # a hung rank's stacks inside a collective call: it waits for a peer
_LIBRARY = re.compile(r"(?:site-packages|dist-packages|/lib/python3\.\d+/|<frozen |/trainer/(?:shim|usercode|"
                      r"resilience|fullrun|runtime|preload)\.py)")
LINK_CONSEQUENCE, LINK_REPEAT = "consequence", "repeat"
_POD = re.compile(r"\(node rank (\d+), (ranks [\d?]+(?:-\d+)?)")  # how ``launchers.pods`` names a pod
_POD_WORDS = {FaultClass.OOM_KILLED: "OOM kill", FaultClass.EVICTED: "eviction",
              FaultClass.NODE_LOST: "lost node"}


@dataclass(frozen=True, slots=True)
class Reading:
    """What attribution needs of one fault, read once."""

    signal: str | None
    exit_code: int | None
    exception_type: str | None
    user_frame: str | None  # "file:function" of the innermost frame outside libraries
    comm_error: bool


def read(f: Fault, data: dict | None = None) -> Reading:
    """``data``: the data of the fault's event, when the caller read it already (``evidence.fault_data``)."""
    message = f.message or ""
    exc_type, exc_msg, frames = evidence.parse_traceback(message)
    sig, code = evidence.kill_facts(f, evidence.fault_data(f) if data is None else data, from_message=True)
    user = next((fr for fr in reversed(frames) if not _LIBRARY.search(fr.file)), None)
    head = message.split("\n", 1)[0][:600] + " " + (exc_type or "") + " " + (exc_msg or "")
    return Reading(signal=sig, exit_code=code, exception_type=exc_type,
                   user_frame=f"{user.file}:{user.function}" if user else None,
                   comm_error=f.fault_class == FaultClass.EXCEPTION and bool(COMM_ERROR.search(head)))


def weight(f: Fault, r: Reading) -> int:
    """How strongly a fault's own evidence says it started the failure (higher: more)."""
    cls = f.fault_class
    if cls in (FaultClass.OOM_KILLED, FaultClass.EVICTED, FaultClass.NODE_LOST, FaultClass.UNSCHEDULABLE,
               FaultClass.IMAGE_PULL):
        return 90
    if f.rank is None and f.detected_by == "launcher":
        return 10  # the job's own launcher process ended: the end of an attempt, not where it failed
    if cls == FaultClass.PROCESS_KILLED:
        if r.signal in STOP_SIGNALS:
            return 15  # stopped: by ft_launcher after a peer failed, or by an operator
        return 80 if (r.signal or r.exit_code is not None) else 30
    if cls in (FaultClass.EXCEPTION, FaultClass.NAN_LOSS):
        if r.comm_error:
            return 20
        if cls == FaultClass.EXCEPTION and r.exception_type is None and r.exit_code is not None:
            return 50  # a rank that exited non-zero without saying why
        return 80
    if cls == FaultClass.HANG:
        # A loop that stopped inside a collective waits for a peer; the one that stopped elsewhere is it.
        return 25 if WAITING.search((f.message or "").split("Stacks of rank", 1)[-1]) else 70
    if cls == FaultClass.STALLED:
        return 65
    if cls == FaultClass.HEARTBEAT_LOST:
        return 60
    return 40


def cause_words(f: Fault, r: Reading) -> str:
    """The primary, as a consequence names it: "rank 1's SIGKILL"."""
    pod = _POD.search(f.message or "") if f.rank is None else None
    who = (f"rank {f.rank}'s" if f.rank is not None else
           f"node rank {pod[1]}'s pod ({pod[2]})'s" if pod else "the job's")
    if f.fault_class in _POD_WORDS:
        return f"{who} {_POD_WORDS[f.fault_class]}"
    if f.fault_class == FaultClass.PROCESS_KILLED and r.signal:
        return f"{who} {r.signal}"
    if f.fault_class == FaultClass.PROCESS_KILLED and r.exit_code is not None:
        return f"{who} exit {r.exit_code}"
    if f.fault_class == FaultClass.EXCEPTION and r.exception_type:
        return f"{who} {r.exception_type}"
    return f"{who} {f.fault_class.replace('_', ' ')}"


def signature(f: Fault, r: Reading) -> tuple:
    """Two failures with the same signature on consecutive restarts are one failure, repeated."""
    return (f.fault_class, r.exception_type, r.user_frame, r.signal,
            r.exit_code if r.signal is None else None,
            f.rank if f.fault_class != FaultClass.EXCEPTION else None)


def _cycle_of(f: Fault) -> str | None:
    c = f.cycle
    if c is None:
        return None
    return c.escalated_to or c.key


_KEY = re.compile(r"^a(\d+)-ij(\d+)(?:-ip(\d+))?$")


def _one_restart(a: str, b: str) -> bool:
    """Two cycle keys of one failure: the same, or an in-process attempt (``a0-ij0-ip1``) and the in-job
    restart of the next round (``a0-ij1``) that replaced it before it could finish."""
    if a == b:
        return True
    ma, mb = _KEY.match(a), _KEY.match(b)
    if ma is None or mb is None or ma[1] != mb[1]:
        return False
    ip, ij = (ma, mb) if ma[3] is not None else (mb, ma)
    return ip[3] is not None and ij[3] is None and int(ij[2]) == int(ip[2]) + 1


def episodes(faults: list[Fault]) -> list[list[Fault]]:
    """The faults (ordered by ``at``) grouped by failure."""
    groups: list[list[Fault]] = []
    by_cycle: dict[str, list[Fault]] = {}
    for f in faults:
        key = _cycle_of(f)
        if key is not None and key in by_cycle:
            by_cycle[key].append(f)
            continue
        near = None
        for g in reversed(groups[-4:]):
            keys = {_cycle_of(x) for x in g} - {None}
            if key is not None and keys and not any(_one_restart(key, k) for k in keys):
                continue  # another restart's faults
            if any(abs((f.at - x.at).total_seconds()) <= EPISODE_S
                   or abs((f.detected_at - x.detected_at).total_seconds()) <= EPISODE_S for x in g):
                near = g
                break
        if near is None:
            near = []
            groups.append(near)
        near.append(f)
        if key is not None:
            by_cycle[key] = near
    return groups


def attribute(job: Job, around: Iterable[datetime] = (), *, now: datetime | None = None) -> int:
    """Re-attribute the faults of ``job`` near the times ``around`` (all of them when empty). Returns the
    number of faults whose attribution changed.

    Inside a transaction, the pass runs again once it commits: two transactions that record faults of one
    failure at the same moment (the watchdog's lost heartbeats, the launcher's report through ingest) each
    see only their own until then, so each would make its faults a failure of their own. The pass after
    the later commit sees both."""
    times = tuple(around)
    changed = _attribute(job, times, now=now)
    connection = transaction.get_connection()
    if connection.in_atomic_block:
        _pass_after_commit(connection, job, times)
    return changed


def _pass_after_commit(connection, job: Job, times: tuple[datetime, ...]) -> None:
    """One pass per job once the transaction commits, over every time it was asked about (all of the
    job's faults when any call asked for all): a transaction that attributes a job several times (a batch
    that closes a cycle, the watchdog claiming rank after rank) would otherwise repeat the pass once per
    call after it commits. The pending pass is looked up among the connection's commit hooks (Django's
    ``run_on_commit``), so a transaction or savepoint rolled back, whose hooks Django drops, leaves none."""
    for _sids, hook, *_robust in connection.run_on_commit:
        if getattr(hook, "attribution_job", None) == job.pk:
            hook.around = None if hook.around is None or not times else hook.around + times
            return

    def after_commit() -> None:
        _attribute(job, after_commit.around or ())

    after_commit.attribution_job = job.pk
    after_commit.around = times or None
    transaction.on_commit(after_commit, robust=True)


def _attribute(job: Job, around: Iterable[datetime] = (), *, now: datetime | None = None) -> int:
    now = now or timezone.now()
    times = sorted(around)
    qs = Fault.objects.filter(job=job).select_related("cycle").order_by("at", "id")
    if times:
        span = timedelta(seconds=4 * EPISODE_S)
        qs = qs.filter(at__gte=times[0] - span - REPEAT_LOOKBACK, at__lte=times[-1] + span)
    faults = list(reversed(qs.reverse()[:MAX_FAULTS]))  # the newest, oldest first
    if not faults:
        return 0
    ids = {f.source_key[6:]: f.pk for f in faults if f.source_key.startswith("event:")}
    data = {ids[e]: d for e, d in Event.objects.filter(job=job, event_id__in=list(ids))
            .values_list("event_id", "data")}
    readings = {f.pk: read(f, data.get(f.pk, {})) for f in faults}
    want: dict[int, tuple[int | None, str, str, int]] = {}  # pk -> (primary, link, why, count)
    primaries: list[Fault] = []
    for g in episodes(faults):
        top = max(g, key=lambda f: (weight(f, readings[f.pk]), -f.at.timestamp(), -f.pk))
        primaries.append(top)
        for f in g:
            if f is top:
                continue
            r = readings[f.pk]
            same = f.rank == top.rank and f.rank is not None
            what = ("the same failure, as " + f.detected_by + " reported it") if same else (
                _echo_words(f, r) + f" — a consequence of {cause_words(top, readings[top.pk])}")
            want[f.pk] = (top.pk, LINK_CONSEQUENCE, what[:300], 1)
    primaries.sort(key=lambda f: (f.at, f.pk))
    root: Fault | None = None
    times_of: dict[int, int] = {}
    prev: Fault | None = None
    for p in primaries:
        r = readings[p.pk]
        if (prev is not None and root is not None and signature(p, r) == signature(prev, readings[prev.pk])
                and (p.progress_at is None or p.progress_at <= prev.at)):
            times_of[root.pk] += 1
            want[p.pk] = (root.pk, LINK_REPEAT, f"the same failure again (first at {root.at:%H:%M:%S})", 1)
        else:
            root = p
            times_of[p.pk] = 1
        prev = p
    for pk, n in times_of.items():
        want[pk] = (None, "", "", n)
    # Consequences point at their episode's root (a repeat's echoes fold under the first occurrence).
    for pk, (primary, link, why, n) in list(want.items()):
        if link == LINK_CONSEQUENCE and primary in want and want[primary][1] == LINK_REPEAT:
            want[pk] = (want[primary][0], link, why, n)
    # A window's first faults may be repeats of faults before it: leave those as they are, but for roots
    # (whose count the window's repeats raise).
    settled_before = times[0] - timedelta(seconds=4 * EPISODE_S) if times else None
    changed = 0
    with transaction.atomic():
        for f in faults:
            target = want[f.pk]
            if settled_before is not None and f.at < settled_before and target[1] == "" and f.link:
                continue
            if (f.primary_id, f.link, f.why, f.count) != target:
                Fault.objects.filter(pk=f.pk).update(primary_id=target[0], link=target[1], why=target[2],
                                                     count=target[3], attributed_at=now)
                changed += 1
    return changed


def _echo_words(f: Fault, r: Reading) -> str:
    who = f"rank {f.rank}" if f.rank is not None else "the job's launcher"
    if r.comm_error:
        lib = "NCCL" if re.search(r"nccl", f.message or "", re.I) else "gloo" if re.search(
            r"gloo", f.message or "", re.I) else "communication"
        reset = re.search(r"reset|closed|broken pipe", f.message or "", re.I)
        what = "connection reset" if reset else "error"
        return f"{who}: {lib} {what}"
    if f.fault_class == FaultClass.PROCESS_KILLED and r.signal in STOP_SIGNALS:
        return f"{who}: stopped ({r.signal})"
    if f.fault_class == FaultClass.HANG and WAITING.search(f.message or ""):
        return f"{who}: waiting in a collective"
    if r.exit_code is not None and r.signal is None:
        return f"{who}: exit {r.exit_code}"
    return f"{who}: {f.fault_class.replace('_', ' ')}"


def occurrences(f: Fault) -> list[datetime]:
    """When a primary fault happened, itself and each repeat, oldest first."""
    reps = list(Fault.objects.filter(primary=f, link=LINK_REPEAT).values_list("at", flat=True))
    return sorted([f.at, *reps])


def consequences(f: Fault) -> list[Fault]:
    return list(Fault.objects.filter(primary=f, link=LINK_CONSEQUENCE).order_by("at", "id"))


__all__ = ["COMM_ERROR", "EPISODE_S", "attribute", "consequences", "episodes", "occurrences", "read",
           "signature", "weight"]
