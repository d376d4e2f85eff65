"""Restart cycles from new events: each cycle mark and fault names its cycle; the rows keep every mark's
earliest time, and the job's status follows the cycles as they open and close.

A batch is read first and folded in Python (``CycleFacts.changes``), and only what moves is written: the
thousands of batches of a job-wide restart repeat the same marks, so all but a few cost one plain SELECT,
take no row lock and leave the job's status alone. Writers lock the rows (in key order) and fold again on
what they then read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db.models import Q

from controlplane.jobs import attribution, notifications
from controlplane.jobs.models import Command, Job, JobStatus, Notification, RestartCycle
from controlplane.jobs.rank_rows import utc
from controlplane.jobs.services import freshest_step, set_status
from trainer.wire import CycleMark, Layer


@dataclass
class CycleFacts:
    """What one batch's cycle marks and faults say about each cycle they name, by cycle key."""

    marks: dict[str, dict[str, datetime]] = field(default_factory=dict)
    layers: dict[str, str] = field(default_factory=dict)
    resumed: dict[str, int] = field(default_factory=dict)
    first_steps: dict[str, int] = field(default_factory=dict)
    at_fault: dict[str, int] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    commands: dict[str, int] = field(default_factory=dict)
    restored: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, cycle_events: list[Any], fault_events: list[Any]) -> CycleFacts:
        facts = cls()
        for e in cycle_events:
            facts.add_mark(e)
        for e in fault_events:  # a fault names its cycle: the cycle exists and started no later than it
            facts.add_fault(e)
        return facts

    def add_mark(self, e: Any) -> None:
        key, mark, at = e.data["cycle"], e.data["mark"], utc(e.at)
        m = self.marks.setdefault(key, {})
        if mark not in m or at < m[mark]:
            m[mark] = at
        if e.data.get("layer"):
            self.layers.setdefault(key, e.data["layer"])
        if e.data.get("command_id") is not None:
            self.commands.setdefault(key, e.data["command_id"])
        step = e.data.get("step")
        if step is not None:
            if mark in (CycleMark.CHECKPOINT_LOADED, CycleMark.RESTARTED):
                resumed = self.resumed
                resumed[key] = step if mark == CycleMark.CHECKPOINT_LOADED else resumed.get(key, step)
            elif mark == CycleMark.FAULT:
                self.at_fault.setdefault(key, step)
            elif mark == CycleMark.FIRST_STEP:
                self.first_steps[key] = step
        if mark == CycleMark.CHECKPOINT_LOADED and e.data.get("restored_from"):
            self.restored[key] = e.data["restored_from"]

    def add_fault(self, e: Any) -> None:
        key = e.data.get("cycle")
        if not key:
            return
        self.marks.setdefault(key, {})
        if e.data.get("step") is not None:
            self.at_fault.setdefault(key, e.data["step"])
        self.reasons.setdefault(key, f"{e.data['fault']}: {e.data.get('message') or ''}".strip(": ")[:200])

    def changes(self, c: RestartCycle) -> dict[str, Any]:
        """What this batch changes in cycle ``c`` (empty: nothing)."""
        k = c.key
        changes: dict[str, Any] = {}
        for mark, at in self.marks[k].items():
            if getattr(c, mark) is None or getattr(c, mark) > at:  # each mark keeps its earliest time
                changes[mark] = at
        if k in self.layers and c.layer == Layer.NONE:
            changes["layer"] = self.layers[k]
        if k in self.resumed:
            if c.resumed_from_step != self.resumed[k]:
                changes["resumed_from_step"] = self.resumed[k]
        elif k in self.first_steps and c.resumed_from_step is None:
            # Level 0/1: no checkpoint step; the first step after the restart follows it
            changes["resumed_from_step"] = max(0, self.first_steps[k] - 1)
        if k in self.restored and c.restored_from != self.restored[k]:
            changes["restored_from"] = self.restored[k]
        if k in self.at_fault and c.step_at_fault is None:
            changes["step_at_fault"] = self.at_fault[k]
        if k in self.reasons and c.reason == "":
            changes["reason"] = self.reasons[k]
        if k in self.commands and c.command_id != self.commands[k]:
            changes["command"] = self.commands[k]  # linked by the writer (_link_command)
        return changes


def apply_cycles(job: Job, cycle_events: list[Any], fault_events: list[Any],
                 now: datetime) -> dict[str, RestartCycle]:
    """Upsert the cycles these events name; keep each mark's earliest time; move the job's status."""
    facts = CycleFacts.of(cycle_events, fault_events)
    if not facts.marks:
        return {}
    keys = sorted(facts.marks)  # one lock order for concurrent writers
    cycles = {c.key: c for c in RestartCycle.objects.filter(job=job, key__in=keys)}
    if len(cycles) == len(keys) and not any(facts.changes(c) for c in cycles.values()):
        return cycles
    cycles, missing = _lock_or_create(job, keys, facts)
    touched = {k: cycles[k] for k in missing}
    for k in keys:
        c = cycles[k]
        changes = facts.changes(c)
        command = changes.pop("command", None)
        if changes:
            RestartCycle.objects.filter(pk=c.pk).update(**changes)
            for name, value in changes.items():
                setattr(c, name, value)
            touched[k] = c
        if command is not None and _link_command(job, c, command):
            cycles[k] = touched[k] = RestartCycle.objects.get(pk=c.pk)
    _cycle_status(job, touched, now)
    return cycles


def _lock_or_create(job: Job, keys: list[str], facts: CycleFacts
                    ) -> tuple[dict[str, RestartCycle], list[str]]:
    """The cycles of ``keys``, locked; those missing are created first (a fault's step, else the control
    plane's freshest step as its estimate). Returns them and the keys that were missing."""
    cycles = _locked_cycles(job, keys)
    missing = [k for k in keys if k not in cycles]
    if missing:
        at_fault, layers = facts.at_fault, facts.layers
        estimate = freshest_step(job) if any(k not in at_fault for k in missing) else None
        RestartCycle.objects.bulk_create(
            [RestartCycle(job=job, key=k, layer=layers.get(k, Layer.NONE), step_at_fault=at_fault.get(k),
                          step_at_fault_estimate=None if k in at_fault else estimate)
             for k in missing], ignore_conflicts=True)
        cycles = _locked_cycles(job, keys)
    return cycles, missing


def _locked_cycles(job: Job, keys: list[str]) -> dict[str, RestartCycle]:
    qs = RestartCycle.objects.select_for_update().filter(job=job, key__in=keys).order_by("key")
    return {c.key: c for c in qs}


def _link_command(job: Job, cycle: RestartCycle, command_id: int) -> bool:
    """A restart an operator asked for starts when the command was issued; delivery is its own part.
    True when the cycle row changed."""
    cmd = Command.objects.filter(job=job, pk=command_id).first()
    if cmd is None:
        return False
    qs = RestartCycle.objects.filter(pk=cycle.pk)
    n = qs.filter(command__isnull=True).update(command=cmd, delivered_at=cmd.delivered_at)
    n += qs.filter(Q(fault_at__isnull=True) | Q(fault_at__gt=cmd.issued_at)).update(fault_at=cmd.issued_at)
    n += qs.filter(reason="").update(reason=f"restart command {cmd.pk} ({cmd.level or 'job'})"[:200])
    return n > 0


def _cycle_status(job: Job, touched: dict[str, RestartCycle], now: datetime) -> None:
    """RUNNING -> RECOVERING when a cycle opens; back to RUNNING when a cycle's first step lands and no
    cycle that started later is still open. A late event of an old cycle moves nothing."""
    closed = [c for c in touched.values() if c.first_step_at is not None]
    opened = [c for c in touched.values() if c.first_step_at is None and c.start_at is not None]
    if opened:
        c = max(opened, key=lambda c: c.start_at)
        superseded = RestartCycle.objects.filter(job=job, first_step_at__gt=c.start_at).exists()
        if not superseded:
            why = f" after {c.reason}" if c.reason else ""
            set_status(job, JobStatus.RECOVERING, f"recovering: {c.title}{why}"[:500],
                       only_from=(JobStatus.RUNNING,))
    if closed:
        c = max(closed, key=lambda c: c.first_step_at)
        _close_escalated(job, c)
        still_open = RestartCycle.objects.filter(job=job, first_step_at__isnull=True).exclude(pk=c.pk).filter(
            Q(fault_at__gt=c.first_step_at) | Q(fault_at__isnull=True, detected_at__gt=c.first_step_at)
            | Q(fault_at__isnull=True, detected_at__isnull=True, aborted_at__gt=c.first_step_at)
            | Q(fault_at__isnull=True, detected_at__isnull=True, aborted_at__isnull=True,
                restarted_at__gt=c.first_step_at)).exists()
        took = f" in {c.recovery_s:.1f} s" if c.recovery_s is not None else ""
        article = "an" if c.title[0] in "aeiou" else "a"
        if not still_open and set_status(job, JobStatus.RUNNING, f"recovered by {article} {c.title}{took}",
                                         only_from=(JobStatus.RECOVERING,)):
            recovery = f" in {c.recovery_s:.1f} s" if c.recovery_s is not None else ""
            notifications.enqueue(job, Notification.Transition.RECOVERED, f"recovered:{c.key}",
                                  f"Job #{job.pk} {job.name} recovered{recovery} "
                                  f"({c.title}); training continues.", now=now)


def _close_escalated(job: Job, recovered: RestartCycle) -> None:
    """Close the cycles that were still open when ``recovered`` reached its first step and began no
    later than it did: their layer gave up (e.g. the Wrapper started on a SIGKILL, then ft_launcher
    restarted the group). Each ends at its own last mark, so it stops counting as recovery."""
    marks = ("restarted_at", "aborted_at", "detected_at", "fault_at")
    for other in RestartCycle.objects.filter(job=job, first_step_at__isnull=True).exclude(pk=recovered.pk):
        start = other.start_at
        if start is None or start > recovered.first_step_at:
            continue
        last = max((getattr(other, m) for m in marks if getattr(other, m)), default=start)
        if RestartCycle.objects.filter(pk=other.pk, first_step_at__isnull=True).update(
                first_step_at=last, escalated_to=recovered.key) and other.faults.exists():
            attribution.attribute(job, [start])  # its faults now belong to the cycle that recovered
