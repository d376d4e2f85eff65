"""A job's specification: what to run and how to keep it alive. One typed document, every default written once.

The control plane validates it (``JobSpec.from_dict``: the form, the operator API, the stored column) and
stores it as JSON; the launcher hands it to each rank whole (``ENV_SPEC``, one environment variable), and
the rank decodes it with this same type (``JobSpec.decode``). Bounds and descriptions are the fields'
metadata (``msgspec.Meta``): the operator API's OpenAPI document and the reference table
(``trainer.spec_reference.reference_rows``) read them from here.

Errors are ``SpecError``s keyed by field name, so forms and the API can show them next to the field
(``trainer.spec_errors``); the ``kubernetes`` part is ``trainer.kubernetes_spec``'s.
Standard library and msgspec only: the control plane imports this module without torch.
"""

from __future__ import annotations

import contextvars
import re
from typing import Annotated, Any, Literal

import msgspec

from trainer.kubernetes_spec import KubernetesSpec
from trainer.policy_rules import PolicyError, Rule, parse_rules
from trainer.spec_errors import SpecError, bound_errors, convert
from trainer.spec_errors import described as _d
from trainer.wire import DrillFault, redact

#: The environment variable that carries the whole spec (JSON) from the launcher to each rank.
ENV_SPEC = "UNBROKEN_JOB_SPEC"

#: The node's shared memory (a pod mounts the node's /dev/shm): each rank's copy of its newest async save
#: (``local_checkpoint_copy``). ``UNBROKEN_LOCAL_CKPT_DIR`` moves it (tests, hosts without /dev/shm).
LOCAL_CHECKPOINT_ROOT = "/dev/shm/unbroken"

#: The in-process layer's hard timeout (no progress for this long: the rank is killed). A spec does not set
#: it; ft_launcher's step timeout must exceed it so that the in-process layer gets its chance first.
IN_PROCESS_HARD_TIMEOUT_S = 10.0
IN_PROCESS_SOFT_TIMEOUT_S = 5.0

PRESETS = ("tiny", "small", "1b")
BACKENDS = ("local", "kubernetes")
CHECKPOINT_MODES = ("sync", "async")
# The allowed values of the fields with a closed set, by name, for the words of a decode error.
_CHOICES = {"backend": BACKENDS, "preset": PRESETS, "checkpoint_mode": CHECKPOINT_MODES,
            "image_pull_policy": ("Always", "IfNotPresent", "Never"), "fault": tuple(f.value for f in DrillFault)}
# A user's entrypoint: a script path (``train.py``, ``src/train.py``), a module run like ``python -m``
# (``pkg.train``), or a function (``pkg.train:main``).
_MODULE = r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*"
_ENTRYPOINT = re.compile(rf"^(?:[^\x00\s:][^\x00:]*\.py|{_MODULE}(?::[A-Za-z_][A-Za-z0-9_]*)?)$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Names the launcher owns (identity, rendezvous, our own settings) or that look like secrets: secrets
# reach the job only through its token file / Kubernetes Secret, never as a plain spec value.
_RESERVED_ENV = re.compile(
    r"^(UNBROKEN_|TORCHELASTIC_|RANK$|LOCAL_RANK$|WORLD_SIZE$|LOCAL_WORLD_SIZE$|GROUP_RANK$|"
    r"MASTER_ADDR$|MASTER_PORT$|PYTHONPATH$)"
)
# What "looks like a secret" in a name: refused in spec.env and in a Kubernetes wrapper (manifests).
SECRET_ENV = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|PRIVATE_KEY|API_KEY|ACCESS_KEY)", re.I)
DRILLS_FOR_USER_CODE = ("exception", "hang", "sigkill")


# Set while a stored spec is read back: it was validated when it was stored, and a rule added since must not
# make an existing job unreadable (its types and bounds are still checked).
_STORED = contextvars.ContextVar("stored_spec", default=False)


class Drill(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Inject ``fault`` into ``rank`` when training reaches ``step`` (once per job)."""

    step: Annotated[int, _d("the step before which the fault fires", ge=1)]
    # A string checked with the spec's other rules (JobSpec._drill_errors), so that a bad fault is reported
    # together with every other error of the spec.
    fault: Annotated[str, _d("the fault to inject: " + ", ".join(f.value for f in DrillFault))]
    rank: Annotated[int, _d("the rank that gets it", ge=0)] = 0
    fraction: Annotated[
        float,
        _d(
            "slow_rank only: the extra share of each step the rank spends busy from "
            "``step`` on (0.3 = 30 % slower)",
            gt=0,
            le=10,
        ),
    ] = 0.3

    def as_flag(self) -> str:
        if self.fault == DrillFault.SLOW_RANK:
            return f"{self.step}:{self.fault}:{self.rank}:{self.fraction:g}"
        return f"{self.step}:{self.fault}:{self.rank}"


class JobSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A job's settings. Build it with ``from_dict`` (JSON-like data) or by keywords; both validate."""

    backend: Annotated[
        Literal["local", "kubernetes"],
        _d("where the job runs: processes on the control plane's machine, or pods on a Kubernetes cluster"),
    ] = "local"
    nodes: Annotated[int, _d("nodes (the local backend: 1)", ge=1, le=2**20)] = 1
    procs_per_node: Annotated[
        int, _d("ranks per node (bounded by a rank id's range: simulated fleets put many on one node)", ge=1,
                le=2**31 - 1)
    ] = 2
    preset: Annotated[
        Literal["tiny", "small", "1b"],
        _d("the built-in example model's size (a job without an entrypoint runs it)"),
    ] = "tiny"
    steps: Annotated[int, _d("training steps", ge=1, le=10**9)] = 300
    checkpoint_interval: Annotated[int, _d("save a checkpoint every this many steps", ge=1, le=10**9)] = 20
    checkpoint_mode: Annotated[
        Literal["sync", "async"],
        _d("async: the step goes on while the save is written; sync: the step waits for it"),
    ] = "async"
    keep_checkpoints: Annotated[int, _d("durable checkpoints kept (the oldest are removed)", ge=1, le=1000)] = 3
    local_checkpoint_copy: Annotated[
        bool,
        _d(
            "each rank also keeps a copy of its newest async save in the node's shared memory, which an in-job "
            "restart's new processes load instead of the durable checkpoint (one that would not fit is skipped)"
        ),
    ] = True
    in_process: Annotated[bool, _d("NVRx in-process restarts (an SDK entrypoint function is re-entered)")] = (
        True
    )
    in_job: Annotated[bool, _d("ft_launcher in-job restarts (new rank processes, same job attempt)")] = True
    job_restart: Annotated[bool, _d("the control plane relaunches the job when the layers below give up")] = (
        True
    )
    max_in_process_restarts: Annotated[int, _d("in-process restarts per rank process", ge=0, le=10000)] = 10
    max_in_job_restarts: Annotated[int, _d("in-job restarts per job attempt", ge=0, le=10000)] = 5
    max_job_restarts: Annotated[int, _d("job-level relaunches", ge=0, le=1000)] = 3
    max_no_progress_restarts: Annotated[
        int,
        _d(
            "NVRx 0.6+: ft_launcher stops restarting after this many in-job restarts in a row without a newer "
            "durable checkpoint (0: off); checked against the trainer's NVRx before launch",
            ge=0,
            le=10000,
        ),
    ] = 0
    heartbeat_interval_s: Annotated[
        float, _d("seconds between a rank's reports to the control plane", ge=0.1, le=3600)
    ] = 1.0
    step_timeout_s: Annotated[
        float,
        _d(
            "a rank silent for this long in a plain phase is hung: the control plane marks it and ft_launcher "
            "ends it (its heartbeat timeout)",
            ge=0.1,
            le=7 * 86400,
        ),
    ] = 30.0
    checkpoint_timeout_s: Annotated[
        float, _d("the same for a rank saving or loading a checkpoint (or in another slow phase)", ge=0.1, le=7 * 86400)
    ] = 300.0
    stall_timeout_s: Annotated[
        float,
        _d(
            "ranks that report but whose step does not move for this long are stalled; a script without the SDK "
            "(Level 0) ends such a rank as hung, for a restart",
            ge=0.1,
            le=7 * 86400,
        ),
    ] = 120.0
    storm_restarts: Annotated[
        int, _d("this many restarts without step progress stop the job (a restart storm)", ge=1, le=10000)
    ] = 5
    straggler_margin_pct: Annotated[
        float,
        _d(
            "a rank whose own work per step is more than this many percent above the median of the others' is a "
            "straggler (0: off; else 5..1000)",
            ge=0,
            le=1000,
        ),
    ] = 20.0
    straggler_window_s: Annotated[
        float, _d("seconds over which each rank's work per step is averaged", ge=1, le=600)
    ] = 5.0
    node_agent: Annotated[
        bool,
        _d(
            "one node agent per node relays its ranks' reports as one request per interval (unset in the API: on "
            "past one node)"
        ),
    ] = False
    fork_ranks: Annotated[
        bool,
        _d(
            "fork each rank from a warm fork server: an in-job restart's ranks skip ~2 s of imports, but steps "
            "ran ~8 % slower here"
        ),
    ] = False
    drills: Annotated[tuple[Drill, ...], _d("scheduled fault injections")] = ()
    failure_policy: Annotated[
        tuple[Rule, ...],
        _d(
            "rules from a fault (class, exit code, signal, pod reason) to an action, first match wins; none: "
            "each layer's default"
        ),
    ] = ()
    kubernetes: Annotated[KubernetesSpec | None, _d("the kubernetes backend's settings")] = None
    entrypoint: Annotated[
        str,
        _d(
            "the user's own code: a script (train.py), a module (pkg.train) or a function (pkg.train:main); "
            "empty: the built-in example model (preset)"
        ),
    ] = ""
    args: Annotated[tuple[str, ...], _d("arguments for the entrypoint")] = ()
    working_dir: Annotated[
        str,
        _d(
            "the directory the code runs in (local: an absolute directory on this "
            "machine; kubernetes: the container's)"
        ),
    ] = ""
    python: Annotated[
        str,
        _d(
            "local backend: the interpreter of the environment (virtualenv, conda) where ./trainer and torch are "
            "installed, e.g. /home/me/venv/bin/python; empty: the control plane's own"
        ),
    ] = ""
    env: Annotated[
        dict[str, str], _d("environment variables for the ranks (no secrets: specs are shown in plain text)")
    ] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if _STORED.get():
            return
        errors = bound_errors(self)
        if self.backend not in BACKENDS:
            errors["backend"] = f"must be one of {', '.join(BACKENDS)}"
        if self.preset not in PRESETS:
            errors["preset"] = f"must be one of {', '.join(PRESETS)}"
        if self.checkpoint_mode not in CHECKPOINT_MODES:
            errors["checkpoint_mode"] = "must be sync or async"
        if self.straggler_margin_pct != 0 and not 5 <= self.straggler_margin_pct <= 1000:
            errors["straggler_margin_pct"] = (
                "must be 0 (off) or within 5..1000 percent: below 5 %, ordinary "
                "step-to-step noise would mark ranks"
            )
        if self.step_timeout_s < 2 * self.heartbeat_interval_s:
            errors["step_timeout_s"] = "must be at least twice heartbeat_interval_s, or every beat looks late"
        hard = IN_PROCESS_HARD_TIMEOUT_S
        if (
            self.in_process
            and self.in_job
            and not self.step_timeout_s > hard
            and "step_timeout_s" not in errors
        ):
            errors["step_timeout_s"] = (
                f"must be more than {hard:g} s, the in-process layer's hard timeout: "
                "ft_launcher must not end a rank the in-process layer can still restart"
            )
        if self.backend == "local" and self.nodes != 1:
            errors["nodes"] = "the local backend runs on this machine: use 1 node, or the kubernetes backend"
        if self.python and (
            self.backend != "local" or not self.python.startswith("/") or "\x00" in self.python
        ):
            errors["python"] = (
                "must be an absolute path to an interpreter, for the local backend (kubernetes: the image's)"
            )
        if self.backend == "kubernetes" and self.kubernetes is None:
            errors["kubernetes"] = "the kubernetes backend needs its settings (namespace, image, ...)"
        errors.update(self._user_code_errors())
        try:
            parse_rules(
                list(self.failure_policy),
                in_process=self.in_process,
                in_job=self.in_job,
                job_restart=self.job_restart,
            )
        except PolicyError as e:
            errors.update(e.errors)
        errors.update(self._drill_errors())
        if errors:
            raise SpecError(errors)

    def _drill_errors(self) -> dict[str, str]:
        errors: dict[str, str] = {}
        for i, d in enumerate(self.drills):
            if d.fault not in DrillFault.__members__.values():
                errors[f"drills[{i}].fault"] = f"must be one of {', '.join(f.value for f in DrillFault)}"
            elif not 0 <= d.rank < self.world_size:
                errors[f"drills[{i}].rank"] = f"must be a rank of this job: 0..{self.world_size - 1}"
            elif not 0 < d.step < self.steps:
                errors[f"drills[{i}].step"] = f"must be within 1..{self.steps - 1} (before the last step)"
            elif type(d.fraction) not in (int, float) or not 0 < d.fraction <= 10:
                errors[f"drills[{i}].fraction"] = (
                    "must be a number within 0..10 (0.3: the rank is 30 % slower)"
                )
            elif self.entrypoint and not self.in_process and d.fault not in DRILLS_FOR_USER_CODE:
                errors[f"drills[{i}].fault"] = (
                    f"your own script can be drilled with {', '.join(DRILLS_FOR_USER_CODE)} "
                    "(fired when it reports that step); nan_loss, hang_collective and "
                    "slow_rank need the SDK's entrypoint function with in-process restarts on"
                )
        return errors

    def _user_code_errors(self) -> dict[str, str]:
        errors: dict[str, str] = {}
        if self.entrypoint and not _ENTRYPOINT.match(self.entrypoint):
            errors["entrypoint"] = (
                "name a script (train.py, src/train.py), a module (pkg.train) or a function (pkg.train:main)"
            )
        if not all(type(a) is str and "\x00" not in a for a in self.args):
            errors["args"] = "must be a list of strings"
        elif len(self.args) > 256 or sum(map(len, self.args)) > 16384:
            errors["args"] = "at most 256 arguments and 16 KiB in all"
        elif self.args and not self.entrypoint:
            errors["args"] = "arguments go to your own script: set entrypoint too"
        if self.working_dir and (
            type(self.working_dir) is not str
            or not self.working_dir.startswith("/")
            or "\x00" in self.working_dir
        ):
            errors["working_dir"] = "must be an absolute directory path, e.g. /home/me/project"
        bad = [
            k
            for k, v in self.env.items()
            if type(k) is not str or not _ENV_NAME.match(k) or type(v) is not str or "\x00" in v
        ]
        reserved = [k for k in self.env if type(k) is str and _RESERVED_ENV.match(k)]
        # A secret by its name (HF_TOKEN, DB_PASS) or by its value's shape (sk-..., AKIA..., ghp_...).
        secret = [
            k
            for k, v in self.env.items()
            if type(k) is str and (SECRET_ENV.search(k) or (type(v) is str and redact(f"{k}={v}") != f"{k}={v}"))
        ]
        if bad:
            errors["env"] = f"names must be like MY_VAR and values strings: {', '.join(map(str, bad[:3]))}"
        elif reserved:
            errors["env"] = f"{', '.join(reserved[:3])}: set by the launcher, not by the spec"
        elif secret:
            errors["env"] = (
                f"{', '.join(secret[:3])} looks like a secret: specs are stored and shown in plain "
                "text; put secrets in a file the script reads or a Kubernetes Secret"
            )
        elif len(self.env) > 128 or sum(len(k) + len(v) for k, v in self.env.items()) > 32768:
            errors["env"] = "at most 128 variables and 32 KiB in all"
        return errors

    # -- derived figures --------------------------------------------------------------------------------

    @property
    def runs_user_code(self) -> bool:
        return bool(self.entrypoint)

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def startup_timeout_s(self) -> float:
        """How long ft_launcher waits for a rank's first heartbeat: imports, rendezvous and a checkpoint
        load come before it."""
        return max(120.0, 2 * self.step_timeout_s)

    @property
    def max_restarts_in_job(self) -> int:
        """ft_launcher's budget of group restarts: 0 with in-job restarts off, so a failed rank ends the node
        at once and the control plane decides."""
        return self.max_in_job_restarts if self.in_job else 0

    # -- documents ----------------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Any) -> JobSpec:
        """Build from JSON-like data (the API, the form, the stored column); unknown keys are errors."""
        if not isinstance(data, dict):
            raise SpecError({"spec": "must be an object"})
        unknown = sorted(set(data) - set(cls.__struct_fields__))
        if unknown:
            raise SpecError({k: "unknown field" for k in unknown})
        kwargs = dict(data)
        if "node_agent" not in kwargs and type(kwargs.get("nodes")) is int and kwargs["nodes"] > 1:
            kwargs["node_agent"] = True  # one request per node where there are several: make bench-fleet
        if kwargs.get("entrypoint") and "in_process" not in kwargs:
            kwargs["in_process"] = False  # re-enters only an SDK entrypoint function: opt in
        if "failure_policy" in kwargs:  # the policy's own messages name each bad key of a rule
            try:
                kwargs["failure_policy"] = [r.to_dict() for r in parse_rules(kwargs["failure_policy"] or [])]
            except PolicyError as e:
                raise SpecError(e.errors) from None
        return convert(kwargs, cls, _CHOICES)

    @classmethod
    def from_stored(cls, data: dict[str, Any]) -> JobSpec:
        """A stored spec (``Job.spec``): typed and bounded as ``from_dict``, without rules added after it was
        stored (validated then)."""
        token = _STORED.set(True)
        try:
            return convert(data, cls, _CHOICES)
        finally:
            _STORED.reset(token)

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    def encode(self) -> str:
        """The whole spec as one JSON document (what the launcher hands each rank in ``ENV_SPEC``)."""
        return msgspec.json.encode(self).decode()

    @classmethod
    def decode(cls, text: str | bytes) -> JobSpec:
        """The spec from ``encode``'s document, validated as ``from_dict`` does."""
        try:
            data = msgspec.json.decode(text)
        except msgspec.DecodeError as e:
            raise SpecError({"spec": f"not a JSON document: {e}"}) from None
        return cls.from_dict(data)


# The demo runs for several minutes (about 5 on a laptop CPU, at ~5 steps/s) so a newcomer can try a
# manual restart and a fault injection while it runs; its two drills come about a fifth and three fifths
# of the way in. The README's API example starts the same job.
DEMO_SPEC = JobSpec(
    preset="tiny",
    steps=1500,
    checkpoint_interval=20,
    step_timeout_s=20.0,
    stall_timeout_s=60.0,
    drills=(
        Drill(step=300, fault=DrillFault.EXCEPTION, rank=1),
        Drill(step=900, fault=DrillFault.SIGKILL, rank=0),
    ),
)
