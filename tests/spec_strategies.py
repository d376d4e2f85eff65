"""Hypothesis strategies for job specs (``trainer.jobspec.JobSpec``) and what a rank should report of one."""

from __future__ import annotations

import hashlib
from typing import Any

from hypothesis import reject
from hypothesis import strategies as st

from trainer.jobspec import JobSpec, SpecError
from trainer.wire import DrillFault

_RULES = [
    {"match": {"class": "nan_loss"}, "action": "stop", "after": 2},
    {"match": {"exit_code": 93}, "action": "stop"},
    {"match": {"reason": "OOMKilled"}, "action": "stop_keep", "after": 3, "without_progress": False},
]
_SECONDS = st.floats(min_value=0.1, max_value=3600, allow_nan=False, allow_infinity=False)


@st.composite
def job_specs(
    draw: Any,
    *,
    backend: str = "local",
    user_code: bool | None = None,
    procs_per_node: int | None = None,
    max_steps: int = 400,
    kubernetes: dict[str, Any] | None = None,
) -> JobSpec:
    """Valid specs over every field the ranks and the launcher use (``user_code``: with an entrypoint; None: both)."""
    nodes = 1 if backend == "local" else draw(st.integers(1, 4))
    procs = procs_per_node or draw(st.integers(1, 4))
    steps = draw(st.integers(3, max_steps))
    mine = draw(st.booleans()) if user_code is None else user_code
    in_process, in_job = draw(st.booleans()), draw(st.booleans())
    heartbeat = draw(st.floats(min_value=0.1, max_value=5, allow_nan=False))
    faults = list(DrillFault) if not mine or in_process else ["exception", "hang", "sigkill"]
    drills = draw(
        st.lists(
            st.fixed_dictionaries(
                {
                    "step": st.integers(1, steps - 1),
                    "fault": st.sampled_from(faults),
                    "rank": st.integers(0, nodes * procs - 1),
                    "fraction": st.floats(min_value=0.01, max_value=10, allow_nan=False),
                }
            ),
            max_size=3,
        )
    )
    data: dict[str, Any] = {
        "backend": backend,
        "nodes": nodes,
        "procs_per_node": procs,
        "steps": steps,
        "preset": draw(st.sampled_from(["tiny", "small", "1b"])),
        "checkpoint_interval": draw(st.integers(1, 100)),
        "checkpoint_mode": draw(st.sampled_from(["sync", "async"])),
        "keep_checkpoints": draw(st.integers(1, 10)),
        "local_checkpoint_copy": draw(st.booleans()),
        "in_process": in_process,
        "in_job": in_job,
        "job_restart": draw(st.booleans()),
        "max_in_process_restarts": draw(st.integers(0, 50)),
        "max_in_job_restarts": draw(st.integers(0, 20)),
        "max_job_restarts": draw(st.integers(0, 10)),
        "heartbeat_interval_s": heartbeat,
        "step_timeout_s": draw(st.floats(min_value=max(10.5, 2 * heartbeat), max_value=900, allow_nan=False)),
        "checkpoint_timeout_s": draw(_SECONDS),
        "stall_timeout_s": draw(_SECONDS),
        "storm_restarts": draw(st.integers(1, 50)),
        "straggler_margin_pct": draw(st.one_of(st.just(0.0), st.floats(5, 1000, allow_nan=False))),
        "straggler_window_s": draw(st.floats(1, 600, allow_nan=False)),
        "node_agent": draw(st.booleans()),
        "fork_ranks": draw(st.booleans()),
        "drills": drills,
        "failure_policy": draw(st.lists(st.sampled_from(_RULES), max_size=2, unique_by=lambda r: str(r))),
    }
    if kubernetes is not None:
        data["kubernetes"] = kubernetes
    if mine:
        data["entrypoint"] = draw(st.sampled_from(["train.py", "pkg.train", "pkg.train:main"]))
        data["args"] = draw(
            st.lists(
                st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=12), max_size=4
            )
        )
        data["env"] = draw(
            st.dictionaries(
                st.from_regex(r"MY_[A-Z0-9_]{1,8}", fullmatch=True),
                st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=12),
                max_size=3,
            )
        )
    try:
        return JobSpec.from_dict(data)
    except SpecError:  # a combination the spec refuses (e.g. a policy action for a layer that is off)
        reject()
        raise


def expected_settings(spec: JobSpec) -> dict[str, Any]:
    """What a rank must report it runs with (``TrainConfig.settings``): the spec's own values."""
    return {
        "preset": spec.preset,
        "steps": spec.steps,
        "checkpoint_interval": spec.checkpoint_interval,
        "checkpoint_mode": spec.checkpoint_mode,
        "keep_checkpoints": spec.keep_checkpoints,
        "local_checkpoint_copy": spec.local_checkpoint_copy and spec.checkpoint_mode == "async",
        "in_process": spec.in_process,
        "max_in_process_restarts": spec.max_in_process_restarts,
        "step_timeout_s": spec.step_timeout_s,
        "checkpoint_timeout_s": spec.checkpoint_timeout_s,
        "startup_timeout_s": spec.startup_timeout_s,
        "stall_timeout_s": spec.stall_timeout_s,
        "heartbeat_interval_s": spec.heartbeat_interval_s,
        "straggler_window_s": spec.straggler_window_s,
        "drills": [[d.step, str(d.fault), d.rank, d.fraction] for d in spec.drills],
        "spec_sha256": hashlib.sha256(spec.encode().encode()).hexdigest(),
    }


def expected_launch(spec: JobSpec) -> dict[str, Any]:
    """What ``trainer.launch`` must make of the spec for itself (ft_launcher's side)."""
    return {
        "nnodes": spec.nodes,
        "nproc_per_node": spec.procs_per_node,
        "max_restarts": spec.max_in_job_restarts if spec.in_job else 0,
        "in_job": spec.in_job,
        "max_no_progress_restarts": spec.max_no_progress_restarts,
        "node_agent": spec.node_agent,
        "fork_ranks": spec.fork_ranks and spec.in_job,
        "rules": spec.failure_policy,
        "entrypoint": spec.entrypoint or "trainer.examples.synthetic:train",
        "user_args": list(spec.args) if spec.entrypoint else None,
    }
