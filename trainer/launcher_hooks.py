"""ft_launcher's (or torchrun's) agent, hooked: the launcher's facts as events (a failed round, each failed
rank's exit or signal and stacks, the restart and how long it took) and the failure-policy rules that end
in-job restarts (``policy_rules.stops_in_job``)."""

from __future__ import annotations

import logging
import signal
import time
from typing import Any

from trainer.policy_rules import Decision, Facts, Rule, signal_name, stops_in_job
from trainer.reporter import Reporter
from trainer.runtime import read_hang_stack, take_fault
from trainer.wire import MAX_EVIDENCE_CHARS, CycleMark, EventKind, FaultClass, Layer, cycle_key, redact

log = logging.getLogger("trainer.launch")


class LauncherHooks:
    """Structured launcher facts from the agent (NVRx 0.4.1 has no callback API, so we wrap two methods).

    ``_monitor_workers`` returning FAILED/UNHEALTHY is detection; ``_restart_workers`` stops the group
    (aborted) and starts a new round (restarted).
    """

    def __init__(self, *, reporter: Reporter, attempt: int, app_store: Any, in_job: bool,
                 rules: tuple[Rule, ...] = (), run_dir: str = "", step_timeout_s: float = 30.0):
        self.reporter, self.attempt, self.app_store, self.in_job = reporter, attempt, app_store, in_job
        self.run_dir, self.step_timeout_s = run_dir, step_timeout_s
        self.restarting_cycle: str | None = None
        self.cannot_start = False  # the user's code failed before training started: no more rounds
        self.rules = rules
        self._matched = [0] * len(rules)  # failures each rule matched in this launch (rounds)
        # A rule said this failure is not restarted in-job: no more rounds; the launch fails (EXIT_POLICY_STOP
        # for stop and stop_keep, so the control plane does not relaunch; status 1 for restart_job, so it does).
        self.policy: Decision | None = None
        self._reported: set[int] = set()

    def install(self, agent_cls: Any) -> None:
        hooks = self
        orig_monitor, orig_restart, orig_stop = (agent_cls._monitor_workers, agent_cls._restart_workers,
                                                 agent_cls._stop_workers)

        def _monitor_workers(agent: Any, wg: Any) -> Any:
            result = orig_monitor(agent, wg)
            try:
                if result.state.name in ("UNHEALTHY", "FAILED"):
                    hooks.on_failure(agent, wg, result)
            except Exception:
                log.exception("launcher hook failed (ignored)")
            return result

        def _stop_workers(agent: Any, wg: Any, *a: Any, **kw: Any) -> Any:
            out = orig_stop(agent, wg, *a, **kw)
            if hooks.restarting_cycle:
                hooks.mark(hooks.restarting_cycle, CycleMark.ABORTED)
            return out

        def _restart_workers(agent: Any, wg: Any) -> Any:
            t0 = time.monotonic()
            out = orig_restart(agent, wg)
            cycle, hooks.restarting_cycle = hooks.restarting_cycle, None
            duration = time.monotonic() - t0
            round_ = agent._worker_group.spec.max_restarts - agent._remaining_restarts
            hooks.mark(cycle, CycleMark.RESTARTED)
            hooks.reporter.event(EventKind.LAUNCHER, {
                "message": f"worker group restarted (round {round_}) in {duration:.2f} s",
                "restart_count": round_, "restart_duration_s": round(duration, 3)}, rank=None)
            return out

        agent_cls._monitor_workers = _monitor_workers
        agent_cls._stop_workers = _stop_workers
        agent_cls._restart_workers = _restart_workers

    def mark(self, cycle: str | None, mark: CycleMark, *, at: float | None = None, step: int | None = None,
             command_id: int | None = None) -> None:
        if cycle:
            data = {"cycle": cycle, "layer": Layer.IN_JOB, "mark": mark, "step": step,
                    "command_id": command_id}
            self.reporter.event(EventKind.CYCLE, {k: v for k, v in data.items() if v is not None},
                                at=at, rank=None)

    def on_failure(self, agent: Any, wg: Any, result: Any) -> None:
        detected_at = time.time()
        spec = wg.spec
        remaining = agent._remaining_restarts
        round_ = spec.max_restarts - remaining
        if round_ in self._reported or self.cannot_start or self.policy is not None:
            return  # the agent may look twice (UNHEALTHY, then FAILED; after a fault that ends the launch)
        self._reported.add(round_)
        facts = take_fault(self.app_store, round_) or {}
        if facts.get("fatal"):
            # The same code fails the same way in every round: end the launch now.
            self.cannot_start = True
            agent._remaining_restarts = remaining = 0
        failures = {int(r): {"exitcode": f.exitcode, "signal": _signal_of(f.exitcode), "pid": f.pid,
                             "local_rank": f.local_rank} for r, f in result.failures.items()}
        desc = ", ".join(f"rank {r}: exit {f['exitcode']}" + (f" ({f['signal']})" if f["signal"] else "")
                         for r, f in sorted(failures.items())) or "no exit (rank monitor reported the group)"
        decision = self._policy(failures, facts) if remaining > 0 else None
        if decision is not None:
            agent._remaining_restarts = remaining = 0
            self.policy = decision
            self.reporter.event(EventKind.LAUNCHER, {
                "message": f"failure policy {decision.why}: not restarting in-job ({desc})",
                "policy_rule": (decision.rule or 0) + 1, "policy_action": decision.action}, rank=None)
        will_restart = self.in_job and remaining > 0
        self.reporter.event(EventKind.LAUNCHER, {
            "message": f"worker group {result.state.name} in round {round_}: {desc}; "
                       + (f"restarting ({remaining - 1} restarts left after this)" if will_restart
                          else "no restarts left"),
            "state": result.state.name, "failures": failures, "restart_count": round_,
            "remaining_restarts": remaining}, rank=None)
        if facts.get("kind") == "command" and will_restart:
            self.restarting_cycle = cycle_key(attempt=self.attempt, restart_count=round_ + 1)
            if facts.get("at"):
                self.mark(self.restarting_cycle, CycleMark.FAULT, at=float(facts["at"]),
                          step=facts.get("step"), command_id=facts.get("command_id"))
            self.mark(self.restarting_cycle, CycleMark.DETECTED, at=detected_at)
            return
        first = min(failures) if failures else None
        rank = facts.get("rank", first)
        own = rank if rank in failures else first  # the exit of the rank whose facts these are
        sig = failures.get(own, {}).get("signal") if own is not None else None
        # A rank whose loop stopped beating wrote its stacks (liveness.FtHeartbeats) before ft_launcher's
        # timeout ended it.
        stack = read_hang_stack(self.run_dir, rank, since=detected_at - 2 * self.step_timeout_s - 5) \
            if self.run_dir and type(rank) is int else ""
        code = failures.get(own, {}).get("exitcode") if own is not None else None
        fault = facts.get("fault") or (FaultClass.HANG if stack else _ended_as(sig, code))
        cycle = cycle_key(attempt=self.attempt, restart_count=round_ + 1) if will_restart else None
        self.reporter.event(EventKind.FAULT, {
            "fault": fault, "cycle": cycle, "detected_by": "launcher", "rank": rank,
            "interruption": (f"exit {failures[own]['exitcode']}" + (f" {sig}" if sig else "")
                             if own is not None else result.state.name),
            "message": _with_stack(_with_traceback(facts.get("message") or desc, facts.get("traceback")), rank,
                                   stack),
            **({"step": facts["step"]} if facts.get("step") is not None else {})}, rank=rank)
        if not facts.get("fatal"):  # code that cannot start fails alike everywhere: one fault says it
            workers = [w.global_rank for w in getattr(wg, "workers", ())
                       if getattr(w, "global_rank", None) is not None]
            self._report_peers(failures, round_, cycle, skip=rank, workers=workers,
                               since=detected_at - 2 * self.step_timeout_s - 5)
        if cycle:
            self.restarting_cycle = cycle
            if facts.get("at"):
                self.mark(cycle, CycleMark.FAULT, at=float(facts["at"]), step=facts.get("step"))
            self.mark(cycle, CycleMark.DETECTED, at=detected_at)

    def _report_peers(self, failures: dict[int, dict], round_: int, cycle: str | None, *, skip: Any,
                      workers: list[int] = (), since: float = 0.0) -> None:
        """A fault per other failed rank, with its own exit, facts and (a loop that stopped beating) its
        stacks, and per rank of this node that did not fail but whose loop stopped beating: the control
        plane decides which rank's failure the others echo (a killed rank's exit beside its peers' gloo
        errors; a hung rank beside the peers that wait for it in a collective)."""
        for r in sorted(set(failures) | set(workers)):
            if r == skip:
                continue
            f = failures.get(r)
            stack = read_hang_stack(self.run_dir, r, since=since) if self.run_dir else ""
            if f is None and not stack:
                continue  # alive, and its loop beat: ft_launcher stops it with the group
            own = take_fault(self.app_store, round_, r) or {}
            code, sig = (f["exitcode"], f["signal"]) if f is not None else (None, None)
            exit_words = f"exit {code}" + (f" ({sig})" if sig else "") if f is not None else "no exit yet"
            fault = own.get("fault") or (FaultClass.HANG if stack else _ended_as(sig, code))
            self.reporter.event(EventKind.FAULT, {
                "fault": fault, "cycle": cycle, "detected_by": "launcher", "rank": r,
                "interruption": f"exit {code}" + (f" {sig}" if sig else "") if f is not None else None,
                "message": _with_stack(_with_traceback(own.get("message") or f"rank {r}: {exit_words}",
                                                       own.get("traceback")), r, stack),
                **({"step": own["step"]} if own.get("step") is not None else {})}, rank=r)

    def _policy(self, failures: dict[int, dict], facts: dict) -> Decision | None:
        """The written rule that says this round's failure must not be restarted in-job
        (``policy_rules.stops_in_job``, the control plane's own decision function), counting each rule's matches
        over the launch's rounds."""
        if not self.rules:
            return None
        cases = [Facts(fault_class=facts.get("fault") or _ended_as(f["signal"], f["exitcode"]),
                       exit_code=f["exitcode"] if (f["exitcode"] or 0) > 0 else None,
                       signal=signal_name(f["signal"]) if f["signal"] else None,
                       text=str(facts.get("message") or "")) for f in failures.values()]
        for i, rule in enumerate(self.rules):
            if any(rule.match.matches(c) for c in cases):
                self._matched[i] += 1
        for c in cases:
            d = stops_in_job(self.rules, c, self._matched)
            if d is not None:
                return d
        return None


def _ended_as(sig: str | None, exitcode: int | None) -> FaultClass:
    """The class of a worker's end without facts of its own: killed by a signal, or by an exit of 128+N (how
    a shell or a container runtime reports a signal; 137: the OOM killer); else an exception."""
    return FaultClass.PROCESS_KILLED if sig or (exitcode or 0) >= 128 else FaultClass.EXCEPTION


def _signal_of(exitcode: int | None) -> str | None:
    """The signal that ended a worker (torchelastic's negative exit code), or None (its ``signal_name()``
    says "<N/A>" then)."""
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def _with_stack(message: str, rank: Any, stack: str) -> str:
    if not stack:
        return message
    return redact(f"{message[:1000]}\n\nStacks of rank {rank}'s threads when its heartbeats stopped "
                  f"(faulthandler, most recent call first; ft_launcher then ended it):\n{stack}")[:MAX_EVIDENCE_CHARS]


def _with_traceback(message: str, tb: str | None) -> str:
    return f"{message}\n\n{tb}"[:4000] if tb else message
