"""What a Kubernetes attempt's pods say: pure functions from API dicts (workload, pods, warning events) to
a ``PollResult`` and the faults only the launcher sees. No API calls: ``kubernetes.KubernetesLauncher.poll``
reads the objects, this module classifies them.

A pod's fault: OOMKilled, evicted, node lost (taint eviction, pod GC, node shutdown, pod deleted),
unschedulable, image pull, or a non-zero exit code (process_killed). When one pod fails, the Job controller
deletes the others: those deletions are consequences, not faults (``summarize``).
"""

from __future__ import annotations

import signal
from datetime import datetime

from controlplane.launchers import manifests
from controlplane.launchers.base import LaunchFault, PollResult
from trainer.wire import FaultClass, redact

IMAGE_PULL_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName",
                                "RegistryUnavailable", "SignatureValidationFailed"})
# Container states that will never start: waiting longer does not help.
TERMINAL_WAITING = frozenset({"InvalidImageName", "CreateContainerConfigError", "CreateContainerError"})
# trainer.launch's exit statuses that a job-level restart would only repeat (trainer/launch.py).
FINAL_EXITS = {2: "the launcher refused the job's settings", 3: "the training code cannot start",
               4: "a failure-policy rule stopped the job"}
NODE_LOST_DISRUPTIONS = frozenset({"DeletionByTaintManager", "DeletionByPodGC"})
EVICTION_DISRUPTIONS = frozenset({"EvictionByEvictionAPI", "PreemptionByScheduler", "TerminationByKubelet"})


def node_rank(pod: dict) -> int:
    meta = pod.get("metadata", {})
    raw = (meta.get("annotations") or {}).get(manifests.COMPLETION_INDEX) \
        or (meta.get("labels") or {}).get(manifests.COMPLETION_INDEX)
    try:
        return int(raw)
    except (TypeError, ValueError):
        return 1 << 30


def _ts(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _condition(obj: dict, type_: str) -> dict | None:
    for c in obj.get("status", {}).get("conditions") or []:
        if c.get("type") == type_ and c.get("status") == "True":
            return c
    return None


def needs_events(workload: dict, pods: list[dict], nodes: int) -> bool:
    """Events explain waiting (no pods yet, unschedulable, mounts); skip the call when all run."""
    if workload.get("spec", {}).get("suspend"):
        return False
    return len(pods) < nodes or any(p.get("status", {}).get("phase", "Pending") == "Pending" for p in pods)


def _exit_text(code: int) -> str:
    if code > 128:
        try:
            return f"exit code {code} ({signal.Signals(code - 128).name})"
        except ValueError:
            pass
    return f"exit code {code}"


# The container's own words about its end, appended to the fault's message after a blank line (the fault page
# shows them as the termination reason and message: ``jobs.evidence``); the termination message is capped.
TERMINATION_HEAD = "container {name} terminated: reason {reason}, exit code {code}"
TERMINATION_MESSAGE_MAX = 2000


def termination_detail(term: dict) -> str:
    """``TERMINATION_HEAD`` and, when the container wrote one (``terminationMessagePath``, or the log's
    end with ``FallbackToLogsOnError``), its termination message."""
    head = TERMINATION_HEAD.format(name=manifests.CONTAINER, reason=term.get("reason") or "-",
                                   code=int(term.get("exitCode") or 0))
    if term.get("signal"):
        head += f", signal {term['signal']}"
    message = redact((term.get("message") or "").strip())
    if len(message) > TERMINATION_MESSAGE_MAX:
        message = "…" + message[-TERMINATION_MESSAGE_MAX:]
    return f"{head}\n{message}" if message else head


def _exit_code(pod: dict) -> int | None:
    """The trainer container's exit status, once it has terminated (not for an OOM kill)."""
    for c in pod.get("status", {}).get("containerStatuses") or []:
        term = (c.get("state") or {}).get("terminated")
        if c.get("name") == manifests.CONTAINER and term and term.get("reason") != "OOMKilled":
            return int(term.get("exitCode") or 0)
    return None


def classify_pod(pod: dict, *, procs_per_node: int) -> tuple[str, LaunchFault | None, str]:
    """One pod -> (state: pending|running|succeeded|failed, fault or None, reason).

    A pod's fault: OOMKilled, evicted, node lost (taint eviction, pod GC, node shutdown, pod deleted),
    unschedulable, image pull, or a non-zero exit code (process_killed).
    """
    meta, status = pod.get("metadata", {}), pod.get("status", {})
    uid, name = meta.get("uid", meta.get("name", "")), meta.get("name", "")
    rank = node_rank(pod)
    node = pod.get("spec", {}).get("nodeName", "") or ""
    ranks = f"ranks {rank * procs_per_node}-{(rank + 1) * procs_per_node - 1}" if rank < 1 << 30 else "ranks ?"
    where = f"pod {name} (node rank {rank}, {ranks}{', on ' + node if node else ''})"
    phase = status.get("phase", "Pending")

    def fault(cls: str, message: str, at: float | None = None, detail: str = "") -> LaunchFault:
        return LaunchFault(fault_class=cls, message=f"{where}: {message}" + (f"\n\n{detail}" if detail else ""),
                           source_key=f"{uid}:{cls}", node=node, at=at)

    disruption = _condition(pod, "DisruptionTarget")
    container = next((c for c in status.get("containerStatuses") or [] if c.get("name") == manifests.CONTAINER), {})
    state = container.get("state") or {}
    if phase == "Succeeded":
        return "succeeded", None, ""
    if phase == "Failed" or meta.get("deletionTimestamp") or phase == "Unknown":
        at = _ts(meta.get("deletionTimestamp"))
        if status.get("reason") == "Evicted" or (disruption and disruption.get("reason") in EVICTION_DISRUPTIONS):
            msg = status.get("message") or (disruption or {}).get("message") or "evicted"
            f = fault(FaultClass.EVICTED, f"evicted: {msg}", _ts((disruption or {}).get("lastTransitionTime")) or at)
            return "failed", f, f.message
        if (disruption and disruption.get("reason") in NODE_LOST_DISRUPTIONS) or phase == "Unknown" \
                or status.get("reason") in ("NodeLost", "Terminated", "NodeShutdown"):
            msg = (disruption or {}).get("message") or status.get("message") or "the node stopped responding"
            f = fault(FaultClass.NODE_LOST, f"node lost: {msg}", _ts((disruption or {}).get("lastTransitionTime")) or at)
            return "failed", f, f.message
        term = state.get("terminated")
        if term:
            at = _ts(term.get("finishedAt")) or at
            code = int(term.get("exitCode") or 0)
            detail = termination_detail(term)
            if term.get("reason") == "OOMKilled":
                f = fault(FaultClass.OOM_KILLED, f"out of memory (OOMKilled, {_exit_text(code)})", at, detail)
                return "failed", f, _first_line(f.message)
            last = redact((term.get("message") or "").strip()).splitlines()[-1:] or [""]
            tail = f": {last[0][:300]}" if last[0] else ""
            if code in FINAL_EXITS:
                # Not a fault of the pod: the launcher reported why (with the traceback) as a fault itself.
                return "failed", None, f"{where}: {FINAL_EXITS[code]} (exit {code}){tail}"
            if code != 0:
                f = fault(FaultClass.PROCESS_KILLED, f"trainer exited with {_exit_text(code)}{tail}", at, detail)
                return "failed", f, _first_line(f.message)
            if phase == "Failed":
                return "failed", None, f"{where}: failed with exit code 0"
        if meta.get("deletionTimestamp") and phase != "Failed":
            f = fault(FaultClass.NODE_LOST, "pod deleted while running (node drained or removed, or deleted by hand)", at)
            return "failed", f, f.message
        msg = status.get("message") or status.get("reason") or "failed"
        f = fault(FaultClass.PROCESS_KILLED, f"pod failed: {msg}", at)
        return "failed", f, f.message
    waiting = state.get("waiting") or {}
    if waiting.get("reason") in IMAGE_PULL_REASONS:
        f = fault(FaultClass.IMAGE_PULL, f"cannot pull image {container.get('image', '')}: "
                                         f"{waiting.get('message') or waiting['reason']}")
        return ("failed" if waiting["reason"] in TERMINAL_WAITING else "pending"), f, f.message
    if waiting.get("reason") in TERMINAL_WAITING:
        return "failed", None, f"{where}: {waiting['reason']}: {waiting.get('message', '')}"
    for c in status.get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
            f = fault(FaultClass.UNSCHEDULABLE, f"unschedulable: {c.get('message', '')}",
                      _ts(c.get("lastTransitionTime")))
            return "pending", f, f.message
    if phase == "Running":
        return "running", None, ""
    return "pending", None, f"{where}: {waiting.get('reason') or 'pending'}"


def _first_line(message: str) -> str:
    return message.split("\n", 1)[0]


def summarize(workload: dict, pods: list[dict], events: list[dict], *, nodes: int, procs_per_node: int) -> PollResult:
    """The attempt's state from its workload, pods and warning events (pure)."""
    uid = workload.get("metadata", {}).get("uid", "")
    states, faults, reasons = [], [], []
    deleted: list[LaunchFault] = []  # faults of pods being deleted: maybe causes, maybe consequences
    final: list[str] = []  # pods whose launcher ended with a FINAL_EXITS status
    for pod in pods:
        state, fault, reason = classify_pod(pod, procs_per_node=procs_per_node)
        states.append(state)
        if _exit_code(pod) in FINAL_EXITS:
            final.append(reason)
        if fault is not None:
            (deleted if pod.get("metadata", {}).get("deletionTimestamp") else faults).append(fault)
        if reason and state in ("failed", "pending"):
            reasons.append((state, reason))
    # When one pod fails, the Job controller deletes the others (SIGTERM, exit 143): those are
    # consequences, not faults. Without any other fault, the first deleted pod is the cause (a drain).
    if deleted and not faults and not final:
        faults.append(min(deleted, key=lambda f: f.at or float("inf")))
    reasons.sort(key=lambda r: not any(_first_line(f.message) == r[1] for f in faults))
    done = _condition(workload, "Complete") or _condition(workload, "Completed")
    if done or (len(pods) == nodes and pods and all(s == "succeeded" for s in states)):
        return PollResult(state="succeeded", reason="training finished", faults=faults)
    failed = _condition(workload, "Failed")
    if final:
        reason = f"{final[0]}; fix it and start a new job (a restart would fail the same way)"
        return PollResult(state="failed", reason=reason, faults=faults, retryable=False)
    if failed or "failed" in states:
        seen = {node_rank(p) for p in pods}
        missing = [i for i in range(nodes) if i not in seen]
        if failed and "failed" not in states and missing:
            for i in missing:
                faults.append(LaunchFault(
                    fault_class=FaultClass.NODE_LOST, source_key=f"{uid}:missing-{i}", at=_ts(failed.get("lastTransitionTime")),
                    message=f"the pod of node rank {i} disappeared (its node was removed, or it was deleted)"))
        first = next((r for s, r in reasons if s == "failed"), None)
        reason = first or (_first_line(faults[0].message) if faults else
                           f"{failed.get('reason', 'Failed')}: {failed.get('message', '')}" if failed else "a pod failed")
        return PollResult(state="failed", reason=reason, faults=faults)
    if workload.get("spec", {}).get("suspend"):
        return PollResult(state="pending", reason="launching (suspended until its Secret and Service exist)")
    for ev in events:
        if ev.get("reason") == "FailedScheduling" and not any(f.fault_class == FaultClass.UNSCHEDULABLE for f in faults):
            obj = ev.get("involvedObject", {})
            faults.append(LaunchFault(fault_class=FaultClass.UNSCHEDULABLE, message=f"pod {obj.get('name')}: "
                                      f"unschedulable: {ev.get('message', '')}",
                                      source_key=f"{obj.get('uid') or obj.get('name')}:unschedulable",
                                      at=_ts(ev.get("lastTimestamp") or ev.get("eventTime"))))
    event_text = "; ".join(f"{e.get('reason')}: {e.get('message', '')}" for e in events[-3:])
    if len(pods) < nodes:
        reason = f"waiting for pods ({len(pods)} of {nodes} created)"
        return PollResult(state="pending", reason=f"{reason}; {event_text}" if event_text else reason, faults=faults)
    if "pending" in states:
        first = next((r for s, r in reasons if s == "pending"), "pods pending")
        return PollResult(state="pending", reason=f"{first}; {event_text}" if event_text else first, faults=faults)
    return PollResult(state="running", faults=faults)

