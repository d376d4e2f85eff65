"""Following a job from the terminal: a progress bar (step, loss, steps/s), the log tail, and each fault,
restart cycle and checkpoint printed once, as the operator API first shows it.

Everything is polled from the operator API (about once a second) with the lists' cursors, so a long job
costs the server a few small queries per poll. Without a terminal (CI logs) the bar becomes a plain
progress line every few seconds.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from trainer.cli.client import Client

FINAL = ("succeeded", "failed", "stopped")
LAYER_WORDS = {"in_process": "in-process", "in_job": "in-job", "job": "whole-job", "none": "none"}
PHASES = ("detect", "abort", "restart", "reload", "first_step")


def new_text(seen: str | None, text: str) -> str:
    """What ``text`` (the log's latest tail) adds to ``seen`` (an earlier tail of the same log)."""
    if not seen:
        return text
    if text.startswith(seen):
        return text[len(seen):]
    anchor = seen[-256:]
    at = text.rfind(anchor)
    return text[at + len(anchor):] if at >= 0 else text  # the window moved past all we had: print it all


def _first_line(text: str | None, limit: int = 200) -> str:
    """A reason's first line (reasons can carry a whole traceback: the job page and the API have it)."""
    lines = (text or "").strip().splitlines()
    return lines[0][:limit] if lines else ""


def fault_line(f: dict) -> str:
    where = f"rank {f['rank']}" if f.get("rank") is not None else "the job"
    if f.get("node"):
        where += f" on {f['node']}"
    message = (f.get("message") or "").strip().splitlines()
    first = message[-1] if f.get("traceback") and message else (message[0] if message else "")
    return (f"[bold red]✗ fault {f['id']}[/]: {f['fault_class']} on {escape(where)} (detected by "
            f"{escape(f['detected_by'])}){': ' + escape(first[:160]) if first else ''}")


def cycle_open_line(c: dict) -> str:
    layer = LAYER_WORDS.get(c["layer"], c["layer"])
    return f"[yellow]↻ restart ({layer})[/] begins: {escape(_first_line(c['reason']))}"


def cycle_line(c: dict) -> str:
    d = dict(c["durations"])
    marks = c["marks"]
    if d.get("first_step") is None and d.get("reload") is None and marks.get("restarted_at") \
            and marks.get("first_step_at"):  # no checkpoint load reported (Level 0): restart to first step
        d["first_step"] = (_at(marks["first_step_at"]) - _at(marks["restarted_at"])).total_seconds()
    phases = ", ".join(f"{p.replace('_', ' ')} {d[p]:.1f} s" for p in PHASES if d.get(p) is not None)
    text = (f"[green]↻ restart ({LAYER_WORDS.get(c['layer'], c['layer'])})[/] recovered in "
            f"{c['recovery_s']:.1f} s")
    if phases:
        text += f" ({phases})"
    if c.get("resumed_from_step") is not None:
        text += f"; resumed from step {c['resumed_from_step']}"
    if c.get("lost_steps"):
        text += f", {c['lost_steps']} step{'s' if c['lost_steps'] != 1 else ''} lost"
    if c.get("escalated_to"):
        text += f"; escalated to {c['escalated_to']}"
    return text


def _at(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def checkpoint_line(c: dict) -> str:
    mark = "[green]✓[/]" if c["state"] == "durable" else "[red]✗[/]"
    extra = [c["mode"]]
    if c.get("bytes"):
        extra.append(f"{c['bytes'] / 1e6:.1f} MB")
    if c.get("elapsed_s") is not None:
        extra.append(f"{c['elapsed_s']:.1f} s")
    return f"{mark} checkpoint at step {c['step']} {c['state']} ({', '.join(extra)})"


@dataclass
class Follower:
    """One job's watch: ``poll()`` prints what is new and returns the job as the API shows it now."""

    client: Client
    job_id: int
    console: Console
    show_log: bool = True
    _status: str = ""
    _fault_after: int | None = None
    _cycles_open: set = field(default_factory=set)
    _cycles_done: set = field(default_factory=set)
    _ckpt_after: int | None = None
    _sample_after: int | None = None
    _log_seen: str | None = None
    _log_why_shown: bool = False
    away_since: float | None = None  # when the server stopped answering (the follow waits it out)
    loss: float | None = None
    _rate: deque = field(default_factory=lambda: deque(maxlen=20))  # (monotonic time, step)

    def poll(self) -> dict:
        base = f"/jobs/{self.job_id}"
        job = self.client.get(base)
        if job["status"] != self._status:
            reason = _first_line(job.get("status_reason")).removeprefix(job["status"] + ": ")
            reason = f": {escape(reason)}" if reason else ""
            self.console.print(f"[bold]job {self.job_id} {job['status']}[/]{reason}")
            self._status = job["status"]
        if self.show_log:
            self.print_log(self.client.get(base + "/log"))
        for f in self._page(base + "/faults", "faults", "_fault_after"):
            self.console.print(fault_line(f))
        for c in self.client.all(base + "/cycles", "cycles"):
            if c["recovery_s"] is not None and c["id"] not in self._cycles_done:
                self._cycles_done.add(c["id"])
                self.console.print(cycle_line(c))
            elif c["recovery_s"] is None and c["id"] not in self._cycles_open | self._cycles_done:
                self._cycles_open.add(c["id"])
                self.console.print(cycle_open_line(c))
        self._checkpoints(base)
        samples = self._page(base + "/samples", "samples", "_sample_after")
        losses = [s["loss"] for s in samples if s.get("loss") is not None]
        if losses:
            self.loss = losses[-1]
        self._rate.append((time.monotonic(), job["last_step"]))
        return job

    def steps_per_s(self) -> float | None:
        if len(self._rate) < 2:
            return None
        (t0, s0), (t1, s1) = self._rate[0], self._rate[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 and s1 >= s0 else None

    def _page(self, path: str, key: str, cursor: str) -> list[dict]:
        out: list[dict] = []
        while True:
            page = self.client.get(path, after=getattr(self, cursor), limit=500)
            out += page[key]
            if page[key]:
                setattr(self, cursor, page[key][-1]["id"])
            if not page.get("next"):
                return out

    def _checkpoints(self, base: str) -> None:
        # Rows up to the cursor are all settled; an in-flight one is asked about again on the next poll.
        page = self.client.get(base + "/checkpoints", after=self._ckpt_after, limit=500)
        for c in page["checkpoints"]:
            if c["state"] == "in_flight":
                break
            self.console.print(checkpoint_line(c))
            self._ckpt_after = c["id"]

    def print_log(self, log: dict) -> None:
        """Print the lines of ``log`` (the API's Log) not printed before."""
        text = log.get("text")
        if text is None:
            if log.get("why") and not self._log_why_shown:
                self.console.print(f"[dim](no log: {escape(log['why'])})[/]")
                self._log_why_shown = True
            return
        complete = text[: text.rfind("\n") + 1]  # a line still being written waits for the next poll
        fresh = new_text(self._log_seen, complete)
        self._log_seen = complete or self._log_seen
        for line in fresh.splitlines():
            self.console.print(f"[dim]│ {escape(line)}[/]", highlight=False, soft_wrap=True)


class Bar:
    """The progress bar on a terminal; a plain progress line every ``every_s`` seconds elsewhere."""

    def __init__(self, console: Console, *, every_s: float = 10.0):
        self.console = console
        self.every_s = every_s
        self._last_line = 0.0
        self._progress: Progress | None = None
        self._task = None

    def __enter__(self) -> Bar:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.__exit__(None, None, None)
            self._progress = None

    def update(self, *, step: int, steps: int, loss: float | None, rate: float | None) -> None:
        loss_s = f"{loss:.4g}" if loss is not None else "–"
        rate_s = f"{rate:.2f}" if rate is not None else "–"
        if self._progress is None and self.console.is_terminal:  # drawn from the first figures on
            self._progress = Progress(
                TextColumn("[bold]step {task.completed:.0f}/{task.total:.0f}"), BarColumn(),
                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[rate]} steps/s"),
                TimeElapsedColumn(), console=self.console, transient=False, refresh_per_second=4)
            self._progress.__enter__()
            self._task = self._progress.add_task("train", total=max(steps, step, 1), loss=loss_s, rate=rate_s)
        if self._progress is not None:
            self._progress.update(self._task, completed=step, total=max(steps, step, 1), loss=loss_s,
                                  rate=rate_s)
        elif time.monotonic() - self._last_line >= self.every_s:
            self._last_line = time.monotonic()
            self.console.print(f"step {step}/{steps} loss {loss_s} {rate_s} steps/s", highlight=False)
