"""A fault's evidence and its one-sentence summary, assembled from stored facts.

What proves a fault: for an exception, its type, message and last frames (the rank sends its
traceback with the fault; ``trainer.usercode.record_fault``); for a killed process, the signal or exit
code ft_launcher saw (the fault event's ``interruption``); the phase it happened in (a save in flight at
the fault's time: "during checkpoint save"), the step; and the rank's log lines around the fault's time
when the launcher keeps the job's log (``log_lines``: the caller passes the log text, the launchers own
it). Everything shown is redacted (``wire.redact``) and capped. The sentence's numbers (recovery time,
steps recomputed, the layer) are ``readouts.fault_figures``'s, the one source the fault table, the
timeline and the API read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime

from controlplane.jobs import readouts
from controlplane.jobs.models import Checkpoint, Event, Fault
from trainer.wire import FaultClass, redact

MAX_FRAMES = 8
MAX_LOG_LINES = 60
LOG_BEFORE_S, LOG_AFTER_S = 10.0, 5.0
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>.+)$')
_EXC = re.compile(r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Warning|[A-Z]\w*))(?::\s?(?P<msg>.*))?$")
_SIGNAL = re.compile(r"\b(SIG[A-Z0-9]+)\b")
_EXIT = re.compile(r"\bexit(?: code| status)? (-?\d+)\b")
# How the launchers word an exit status in a fault's message ("exited with code 93", "exit code 93").
_EXIT_SAID = re.compile(r"\bexit(?:ed with)?(?: code| status) (-?\d+)\b")
# A Kubernetes container's end, as ``launchers.pods.termination_detail`` words it in a fault's message.
_TERMINATED = re.compile(r"^container \S+ terminated: reason (?P<reason>\S+), exit code (?P<code>-?\d+)"
                         r"(?:, signal \d+)?$", re.M)
# The launcher's and the ranks' log format: "2026-12-03 15:41:37,123 r1 INFO name: message".
_LOG_LINE = re.compile(r"^(?P<ts>\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}),(?P<ms>\d{3}) (?P<who>\S+) ")

LAYER_ACTS = {
    "in_process": "the NVRx in-process Wrapper restarted the training function",
    "in_job": "ft_launcher restarted the worker group",
    "job": "the control plane relaunched the job",
}
VERBS = {
    FaultClass.EXCEPTION: "raised an exception",
    FaultClass.HANG: "hung",
    FaultClass.PROCESS_KILLED: "was killed",
    FaultClass.NAN_LOSS: "produced a NaN loss",
    FaultClass.HEARTBEAT_LOST: "stopped sending heartbeats",
    FaultClass.STALLED: "stopped making progress",
    FaultClass.NODE_LOST: "lost its node",
    FaultClass.OOM_KILLED: "was killed for running out of memory (OOMKilled)",
    FaultClass.EVICTED: "was evicted",
    FaultClass.UNSCHEDULABLE: "could not be scheduled",
    FaultClass.IMAGE_PULL: "could not pull its image",
}


@dataclass(frozen=True, slots=True)
class Frame:
    file: str
    line: int
    function: str
    code: str


@dataclass(frozen=True, slots=True)
class Evidence:
    summary: str
    message: str = ""  # the fault's message as reported (with its traceback), redacted
    exception_type: str | None = None
    exception_message: str | None = None
    frames: list[Frame] = field(default_factory=list)  # the last ones, innermost last
    signal: str | None = None
    exit_code: int | None = None
    phase: str | None = None  # "checkpoint save" when a save was in flight at the fault's time
    step: int | None = None
    log: list[str] = field(default_factory=list)  # the rank's lines around the fault's time
    log_why: str | None = None  # why there are none
    # Kubernetes: the container's termination reason (OOMKilled, Error, ...) and message, as the kubelet kept them
    reason: str | None = None
    termination_message: str | None = None


def parse_traceback(text: str) -> tuple[str | None, str | None, list[Frame]]:
    """(exception type, its message, the last ``MAX_FRAMES`` frames) of the last traceback in ``text``."""
    lines = text.splitlines()
    frames: list[Frame] = []
    exc_type = exc_msg = None
    for i, line in enumerate(lines):
        m = _FRAME.match(line)
        if m:
            code = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME.match(lines[i + 1]) else ""
            frames.append(Frame(file=m["file"], line=int(m["line"]), function=m["fn"].strip(), code=code))
    if frames:
        for line in reversed(lines):
            m = _EXC.match(line.strip())
            if m and not line.startswith(" "):
                exc_type, exc_msg = m["type"], (m["msg"] or "").strip()
                break
    return exc_type, exc_msg, frames[-MAX_FRAMES:]


def log_lines(text: str | None, *, rank: int | None, at: datetime, until: datetime | None = None) -> list[str]:
    """The lines of ``rank`` (and of the launcher; every rank's for a fault of no one rank, such as a pod's
    or the launcher's own) from ``LOG_BEFORE_S`` before ``at`` to ``LOG_AFTER_S`` after ``until`` (its
    detection; default ``at``), with the untimed lines that follow one of them (a traceback, the stack of a
    hung rank's main thread that the in-process layer logs at abort)."""
    if not text:
        return []
    lo, hi = at.timestamp() - LOG_BEFORE_S, max(at, until or at).timestamp() + LOG_AFTER_S
    wanted = {"launcher", f"r{rank}"} if rank is not None else None
    out: list[str] = []
    keep = False
    for line in text.splitlines():
        m = _LOG_LINE.match(line)
        if m:
            t = datetime.strptime(m["ts"], "%Y-%m-%d %H:%M:%S").timestamp() + int(m["ms"]) / 1000  # local time
            keep = lo <= t <= hi and (wanted is None or m["who"] in wanted)
        if keep:
            out.append(redact(line[:500]))
    return out[-MAX_LOG_LINES:]


def fault_evidence(f: Fault, *, log_text: str | None = None, log_why: str | None = None,
                   rank_nodes: dict[int, str] | None = None, ended: bool = False) -> Evidence:
    """Everything that proves ``f``, with its summary sentence (``ended``: the job is over)."""
    fig = readouts.fault_figures(f, rank_nodes=rank_nodes, ended=ended)
    message = redact(f.message or "")
    exc_type, exc_msg, frames = parse_traceback(message)
    data = fault_data(f)
    sig, code = kill_facts(f, data, message=message)
    term = _TERMINATED.search(message)
    if term is not None and code is None:
        code = int(term["code"])
    step = data.get("step") if type(data.get("step")) is int else (f.cycle.step_at_fault if f.cycle else None)
    saving = Checkpoint.objects.filter(job_id=f.job_id, started_at__lte=f.at).exclude(finished_at__lt=f.at).exists()
    ev = Evidence(summary="", message=message, exception_type=exc_type, exception_message=exc_msg, frames=frames,
                  signal=sig, exit_code=code,
                  phase="checkpoint save" if saving else ("training" if step is not None else None), step=step,
                  log=log_lines(log_text, rank=f.rank, at=f.at, until=f.detected_at), log_why=log_why,
                  reason=term["reason"] if term else None,
                  termination_message=(message[term.end():].strip() or None) if term else None)
    return Evidence(**{**{k: getattr(ev, k) for k in Evidence.__slots__},
                       "summary": attributed_summary(f, ev, summary(f, fig, ev))})


def fault_data(f: Fault) -> dict:
    """The data of the trainer's fault event that recorded ``f`` (empty for the watchdog's and launcher's)."""
    if not f.source_key.startswith("event:"):
        return {}
    return (Event.objects.filter(job_id=f.job_id, event_id=f.source_key[6:]).values_list("data", flat=True)
            .first()) or {}


def kill_facts(f: Fault, data: dict, *, message: str | None = None,
               from_message: bool = False) -> tuple[str | None, int | None]:
    """(signal name, exit code) of a fault: the signal from its interruption or message, the exit code
    from its interruption (ft_launcher's "exit 93"), and with ``from_message`` also from how the launchers
    word it in the message ("exited with code 93", "exit code 137 (SIGKILL)")."""
    message = (f.message or "") if message is None else message
    said = f"{data.get('interruption') or ''} {message}"
    sig = _SIGNAL.search(said)
    code = _EXIT.search(str(data.get("interruption") or ""))
    if code is None and from_message:
        code = _EXIT_SAID.search(message)
    return (sig.group(1) if sig else None), (int(code.group(1)) if code else None)


def summary(f: Fault, fig: readouts.FaultFigures, ev: Evidence) -> str:
    """One sentence: who, what, where in the loop, which layer recovered it how fast, what it cost."""
    who = f"rank {f.rank}" if f.rank is not None else "the job"
    if fig.node:
        who += f" on {fig.node}"
    what = VERBS.get(f.fault_class, f"failed ({f.fault_class})")
    if f.fault_class == FaultClass.PROCESS_KILLED and ev.signal:
        what = f"was killed by {ev.signal}" + sender(f, ev)
    elif f.fault_class == FaultClass.PROCESS_KILLED and ev.exit_code is not None:
        what = f"exited with code {ev.exit_code}" + sender(f, ev)
    elif f.fault_class == FaultClass.EXCEPTION and ev.exception_type:
        what = f"raised {ev.exception_type}" + (f" ({ev.exception_message[:80]})" if ev.exception_message else "")
    if ev.phase == "checkpoint save":
        what += " during checkpoint save"
    if ev.step is not None:
        what += f" at step {ev.step}"
    act = LAYER_ACTS.get(fig.layer or "")
    if act is None:
        then = "no restart layer handled it"
    elif fig.recovering:
        then = act.replace("restarted", "is restarting").replace("relaunched", "is relaunching")
    elif fig.recovery_s is None and not fig.escalated_to:  # the job ended before the restart's first step
        then = (act.replace("restarted", "was restarting").replace("relaunched", "was relaunching")
                + " when the job ended")
    elif fig.escalated_to:
        then = act.replace("restarted", "tried to restart") + f", then handed it on to {fig.escalated_to}"
    else:
        then = act + (f" in {fig.recovery_s:.1f} s" if fig.recovery_s is not None else "")
    out = f"{who} {what}; {then}"
    if fig.lost_steps is not None:
        out += f"; {fig.lost_steps} step{'s were' if fig.lost_steps != 1 else ' was'} recomputed"
    return out[:1].upper() + out[1:] + "."


_PATH = re.compile(r"(/[\w.\-]+(?:/[\w.\-]+)+)")
_SENDERS = (("drill", "a fault drill"), ("oom", "the kernel's OOM killer"),
            ("restart command", "an operator's restart command"),
            ("stop command", "an operator's stop command"))


def sender(f: Fault, ev: Evidence) -> str:
    """Who sent a signal, where the evidence says (" (a fault drill)"); "" when it does not."""
    low = (f.message or "").lower()
    for word, who in _SENDERS:
        if word in low:
            return f" ({who})"
    if ev.signal is None and ev.exit_code == 137:
        return " (SIGKILL, as an OOM kill reports it)"
    if ev.signal == "SIGTERM" and f.link == "consequence":
        return " (ft_launcher's stop)"
    return ""


def loading(ev: Evidence) -> bool:
    """The exception came from loading a checkpoint (the resume itself failed)."""
    said = f"{ev.exception_type or ''} {ev.exception_message or ''}".lower()
    return "checkpoint" in said or "metadata" in said or any(
        "load" in fr.function.lower() or "load" in fr.code.lower() or "restore" in fr.function.lower()
        for fr in ev.frames)


def attributed_summary(f: Fault, ev: Evidence, base: str) -> str:
    """``summary`` with what attribution found: whose failure a consequence echoes; a primary's
    consequences and repeats (a resume that fails on every restart names its path and error)."""
    if f.link == "consequence" and f.primary_id:
        return f"{f.why[:1].upper()}{f.why[1:]} (fault {f.primary_id})."
    if f.link == "repeat" and f.primary_id:
        return f"The same failure as fault {f.primary_id}, again on the next restart. {base}"
    out = base.rstrip(".")
    if f.count > 1 and ev.exception_type and loading(ev):
        paths = _PATH.findall(f"{ev.exception_message or ''} {ev.message}")
        where = next((p for p in paths if re.search(r"step|ckpt|checkpoint", p, re.I)), None)
        out = (f"Every restart fails the same way while loading a checkpoint ({f.count} times): the resume "
               f"itself fails ({ev.exception_type}" + (f" reading {where}" if where else "")
               + (f": {ev.exception_message[:120]}" if ev.exception_message else "") + "). " + out)
    elif f.count > 1:
        out += f"; the same failure happened {f.count} times on consecutive restarts"
    echoes = list(Fault.objects.filter(primary_id=f.pk, link="consequence").order_by("at", "id")
                  .values_list("why", flat=True)[:4])
    if echoes:
        words = [w.split(" — ", 1)[0] for w in echoes if " — " in w][:3]
        if words:
            verb = " was" if len(words) == 1 else " were"
            out += "; " + ", ".join(_echo_phrase(w) for w in words) + verb + " a consequence"
    return out + "."


def _echo_phrase(words: str) -> str:
    """"rank 0: gloo connection reset" -> "rank 0's gloo connection reset"."""
    who, _, what = words.partition(": ")
    return f"{who}'s {what}" if what else who
