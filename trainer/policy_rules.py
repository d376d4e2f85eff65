"""Failure policies: which action the next fault causes. One definition, pure, for both sides.

A job's spec may carry rules (``failure_policy``), checked in order; the first rule that matches a fault and
has reached its count (``after``) decides. Without a matching rule the default applies, and the default is
what each layer does today: the NVRx in-process Wrapper retries what it catches, ft_launcher restarts the
worker group, the control plane relaunches the job, each until its budget is spent. So nothing changes
unless a rule is written.

The control plane evaluates every fault it records (``controlplane.jobs.policy``) and carries out what a
written rule decides (stop, stop and keep for debugging, restart the job, restart in-job, notify);
ft_launcher's hooks (``trainer.launch``) read the same rules to stop restarting in-job on a fault whose
rule says the job must not go on (``exit code 93: stop``). Example rules::

    [{"match": {"class": "nan_loss"}, "action": "stop", "after": 2},
     {"match": {"exit_code": 93}, "action": "stop"},
     {"match": {"reason": "OOMKilled"}, "action": "stop_keep"}]
"""

from __future__ import annotations

import re
import signal as _signal
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import msgspec

from trainer.wire import FaultClass


class Action(StrEnum):
    RETRY_IN_PROCESS = "retry_in_process"  # the NVRx Wrapper re-enters the training function
    RESTART_IN_JOB = "restart_in_job"  # ft_launcher restarts the worker group
    RESTART_JOB = "restart_job"  # the control plane relaunches every process or pod
    STOP_KEEP = "stop_keep"  # stop restarting; freeze the processes / keep the pods for debugging
    STOP = "stop"  # stop for good: the job fails and its processes or pods are removed
    NOTIFY = "notify"  # tell the job's webhook / email; change nothing else
    MARK = "mark"  # (default only) record it; nothing acts


ACTION_WORDS = {
    Action.RETRY_IN_PROCESS: "in-process restart",
    Action.RESTART_IN_JOB: "in-job restart (ft_launcher)",
    Action.RESTART_JOB: "whole-job restart",
    Action.STOP_KEEP: "stop, keep processes/pods for debugging",
    Action.STOP: "stop the job",
    Action.NOTIFY: "notify",
    Action.MARK: "recorded, no action",
}
# Actions a rule may name (MARK is what happens to a straggler or a stall when no rule is written).
RULE_ACTIONS = tuple(a for a in Action if a != Action.MARK)
STRAGGLER = "straggler"  # a match class beside the fault classes: a rank marked as a straggler
MATCH_CLASSES = (*(c.value for c in FaultClass), STRAGGLER)
# What the NVRx in-process Wrapper catches: the rank raised (or its loop stopped moving) but is alive.
IN_PROCESS_CLASSES = frozenset({FaultClass.EXCEPTION, FaultClass.NAN_LOSS, FaultClass.HANG})
# What takes a whole pod or the job's launcher with it: only a job-level restart brings it back.
POD_CLASSES = frozenset({FaultClass.NODE_LOST, FaultClass.OOM_KILLED, FaultClass.EVICTED})
# What never started: the launcher waits, then fails the job (``launchers.services.PENDING_TIMEOUT``).
START_CLASSES = frozenset({FaultClass.UNSCHEDULABLE, FaultClass.IMAGE_PULL})
MAX_RULES = 32
_REASON = re.compile(r"^[A-Za-z][A-Za-z0-9]{0,62}$")


class PolicyError(ValueError):
    """Bad rules; ``errors`` maps a field (``failure_policy[0].match.class``) to what fixes it."""

    def __init__(self, errors: dict[str, str]):
        super().__init__("; ".join(f"{k}: {v}" for k, v in errors.items()))
        self.errors = errors


def signal_name(value: str | int | None) -> str | None:
    """``9``, ``"KILL"``, ``"sigkill"`` -> ``"SIGKILL"``; None when it names no signal."""
    if value is None:
        return None
    try:
        if type(value) is int:
            return _signal.Signals(value).name
        text = str(value).strip().upper()
        text = text if text.startswith("SIG") else "SIG" + text
        return _signal.Signals[text].name
    except (KeyError, ValueError):
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class Facts:
    """What is known about one fault: its class, and when known the exit code, the signal and the words
    (pod or container reasons such as OOMKilled, Evicted) that the launcher or the rank reported."""

    fault_class: str
    exit_code: int | None = None
    signal: str | None = None
    text: str = ""  # the fault's message: a rule's ``reason`` matches a whole word of it


class Match(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """What a rule matches (one or more of a fault's class, exit code, signal, reason); JSON names it
    ``class``, not ``fault_class``."""

    fault_class: str | None = msgspec.field(default=None, name="class")
    exit_code: int | None = None
    signal: str | None = None
    reason: str | None = None

    def matches(self, f: Facts) -> bool:
        if self.fault_class is not None and f.fault_class != self.fault_class:
            return False
        if self.exit_code is not None and f.exit_code != self.exit_code:
            return False
        if self.signal is not None and f.signal != self.signal:
            return False
        if self.reason is not None and not re.search(rf"\b{re.escape(self.reason)}\b", f.text):
            return False
        return True

    def words(self) -> str:
        parts = [self.fault_class or ""]
        if self.exit_code is not None:
            parts.append(f"exit code {self.exit_code}")
        if self.signal:
            parts.append(self.signal)
        if self.reason:
            parts.append(self.reason)
        return " ".join(p for p in parts if p) or "any fault"

    def to_dict(self) -> dict[str, Any]:
        out = {"class": self.fault_class, "exit_code": self.exit_code, "signal": self.signal,
               "reason": self.reason}
        return {k: v for k, v in out.items() if v is not None}


class Rule(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """On the ``after``-th fault that ``match``es (counted since the job last made step progress, or over
    the whole job with ``without_progress`` false), take ``action``."""

    match: Match
    action: str
    after: int = 1
    without_progress: bool = True

    def words(self) -> str:
        n = "" if self.after == 1 else f" ×{self.after}" + (" without progress" if self.without_progress else "")
        return f"{self.match.words()}{n} → {ACTION_WORDS[Action(self.action)]}"

    def to_dict(self) -> dict[str, Any]:
        return {"match": self.match.to_dict(), "action": self.action, "after": self.after,
                "without_progress": self.without_progress}


def parse_rules(data: Any, *, in_process: bool = True, in_job: bool = True, job_restart: bool = True,
                field: str = "failure_policy") -> tuple[Rule, ...]:
    """Rules from JSON-like data (a list of ``{"match": {...}, "action": ..., "after": N}``), checked against
    the layers the job turns on. Raises ``PolicyError`` naming each bad field."""
    if isinstance(data, (tuple, list)) and all(isinstance(r, Rule) for r in data):
        data = [r.to_dict() for r in data]
    if not isinstance(data, list):
        raise PolicyError({field: 'must be a list of rules, e.g. [{"match": {"class": "nan_loss"}, '
                                  '"action": "stop", "after": 2}]'})
    if len(data) > MAX_RULES:
        raise PolicyError({field: f"at most {MAX_RULES} rules"})
    errors: dict[str, str] = {}
    rules = []
    for i, raw in enumerate(data):
        at = f"{field}[{i}]"
        if not isinstance(raw, dict):
            errors[at] = 'must be an object: {"match": {...}, "action": ...}'
            continue
        unknown = sorted(set(raw) - {"match", "action", "after", "without_progress"})
        if unknown:
            errors[f"{at}.{unknown[0]}"] = "unknown field: use match, action, after, without_progress"
            continue
        m = raw.get("match")
        if not isinstance(m, dict) or not m:
            errors[f"{at}.match"] = "must be an object with one or more of class, exit_code, signal, reason"
            continue
        bad = sorted(set(m) - {"class", "exit_code", "signal", "reason"})
        if bad:
            errors[f"{at}.match.{bad[0]}"] = "unknown field: match on class, exit_code, signal or reason"
            continue
        cls, code, sig, reason = m.get("class"), m.get("exit_code"), m.get("signal"), m.get("reason")
        if cls is not None and cls not in MATCH_CLASSES:
            errors[f"{at}.match.class"] = f"must be one of {', '.join(MATCH_CLASSES)}"
        if code is not None and (type(code) is not int or not 1 <= code <= 255):
            errors[f"{at}.match.exit_code"] = "must be an exit status within 1..255"
        if sig is not None and (type(sig) not in (str, int) or signal_name(sig) is None):
            errors[f"{at}.match.signal"] = "must name a signal, e.g. SIGKILL, SIGSEGV or 9"
        if reason is not None and (type(reason) is not str or not _REASON.match(reason)):
            errors[f"{at}.match.reason"] = "must be one word, as Kubernetes reports it: OOMKilled, Evicted, Error"
        action = raw.get("action")
        if action not in RULE_ACTIONS:
            errors[f"{at}.action"] = f"must be one of {', '.join(RULE_ACTIONS)}"
        elif action == Action.RETRY_IN_PROCESS and not in_process:
            errors[f"{at}.action"] = "in-process restarts are off for this job (in_process): pick another action"
        elif action == Action.RETRY_IN_PROCESS and cls not in IN_PROCESS_CLASSES:
            errors[f"{at}.action"] = ("only exception, nan_loss and hang can be retried in-process (set "
                                      "match.class); a killed rank needs restart_in_job or restart_job")
        elif action == Action.RESTART_IN_JOB and not in_job:
            errors[f"{at}.action"] = "in-job restarts are off for this job (in_job): pick another action"
        elif action == Action.RESTART_JOB and not job_restart:
            errors[f"{at}.action"] = "job-level restarts are off for this job (job_restart): pick another action"
        after = raw.get("after", 1)
        if type(after) is not int or not 1 <= after <= 1000:
            errors[f"{at}.after"] = "must be a count within 1..1000 (the rule acts on the Nth matching fault)"
        wp = raw.get("without_progress", True)
        if type(wp) is not bool:
            errors[f"{at}.without_progress"] = "must be true or false"
        if any(k.startswith(at) for k in errors):
            continue
        rules.append(Rule(match=Match(fault_class=cls, exit_code=code, signal=signal_name(sig), reason=reason),
                          action=action, after=after, without_progress=wp))
    if errors:
        raise PolicyError(errors)
    return tuple(rules)


@dataclass(frozen=True, slots=True, kw_only=True)
class Budget:
    """The layers a job turns on and the restarts each has left now (None: not counted here)."""

    in_process: bool = True
    in_job: bool = True
    job_restart: bool = True
    in_process_left: int | None = None
    in_job_left: int | None = None
    job_left: int | None = None
    storm_left: int | None = None  # restarts without progress before the restart-storm rule stops the job


@dataclass(frozen=True, slots=True)
class Decision:
    action: str
    rule: int | None  # the written rule (its index) that fired; None: the default
    why: str  # the rule in words, or why the default is what it is

    @property
    def written(self) -> bool:
        return self.rule is not None

    def words(self) -> str:
        return f"{ACTION_WORDS[Action(self.action)]} ({self.why})"


def _left(n: int | None) -> bool:
    return n is None or n > 0


def default_decision(fault_class: str, b: Budget) -> Decision:
    """What the layers do today with a fault of this class, given what they have left."""
    if fault_class == STRAGGLER:
        return Decision(Action.MARK, None, "default: a straggler is marked on the rank table and timeline")
    if fault_class == FaultClass.STALLED:
        return Decision(Action.NOTIFY, None, "default: a stall is notified; ft_launcher's heartbeat timeout "
                                             "restarts a rank that stops beating")
    if fault_class in START_CLASSES:
        return Decision(Action.STOP, None, "default: the job fails if its pods cannot start within the "
                                           "pending timeout")
    if b.storm_left is not None and b.storm_left <= 0:
        return Decision(Action.STOP, None, "default: restart storm (storm_restarts restarts without progress)")
    chain = []
    if fault_class in IN_PROCESS_CLASSES:
        chain.append((b.in_process and _left(b.in_process_left), Action.RETRY_IN_PROCESS, "in_process",
                      b.in_process_left))
    if fault_class not in POD_CLASSES:
        chain.append((b.in_job and _left(b.in_job_left), Action.RESTART_IN_JOB, "in_job", b.in_job_left))
    chain.append((b.job_restart and _left(b.job_left), Action.RESTART_JOB, "job_restart", b.job_left))
    for ok, action, flag, left in chain:
        if ok:
            return Decision(action, None, f"default: {flag} on" + (f", {left} left" if left is not None else ""))
    return Decision(Action.STOP, None, "default: every restart layer is off or used up")


def decide(rules: Sequence[Rule], facts: Facts, counts: Sequence[int], budget: Budget) -> Decision:
    """The decision for a fault with ``facts``. ``counts[i]``: faults matching rule ``i`` in its window,
    this one included. The first matching rule that has reached its count decides; a restart action whose
    layer is used up falls back to the default (the layers' budgets are caps no rule lifts)."""
    for i, rule in enumerate(rules):
        if not rule.match.matches(facts) or counts[i] < rule.after:
            continue
        left = {Action.RETRY_IN_PROCESS: budget.in_process_left, Action.RESTART_IN_JOB: budget.in_job_left,
                Action.RESTART_JOB: budget.job_left}.get(Action(rule.action))
        if left is not None and left <= 0:
            continue
        return Decision(rule.action, i, f"rule {i + 1}: {rule.words()}")
    return default_decision(facts.fault_class, budget)


def stops_in_job(rules: Sequence[Rule], facts: Facts, counts: Sequence[int]) -> Decision | None:
    """For ft_launcher: the written rule that says this failure must not be restarted in-job (stop, stop and
    keep, or restart the whole job), or None."""
    d = decide(rules, facts, counts, Budget())
    if d.written and d.action in (Action.STOP, Action.STOP_KEEP, Action.RESTART_JOB):
        return d
    return None


__all__ = ["ACTION_WORDS", "RULE_ACTIONS", "STRAGGLER", "Action", "Budget", "Decision", "Facts", "Match",
           "PolicyError", "Rule", "decide", "default_decision", "parse_rules", "signal_name", "stops_in_job"]
