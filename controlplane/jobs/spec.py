"""A job's spec: what to run and how to keep it alive. Validated once, stored as JSON on the Job.

Errors are ``SpecError``s keyed by field name, so forms and the API can show them next to the field.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from trainer.config import TrainConfig
from trainer.policy import PolicyError, Rule, parse_rules
from trainer.wire import DrillFault

# The in-process layer's hard timeout, as the trainer defaults it (a spec does not set it).
_TRAINER_HARD_TIMEOUT_S: float = next(f.default for f in dataclasses.fields(TrainConfig) if f.name == "hard_timeout")

PRESETS = ("tiny", "small", "1b")
BACKENDS = ("local", "kubernetes")
CHECKPOINT_MODES = ("sync", "async")
# A user's entrypoint: a script path (``train.py``, ``src/train.py``), a module run like ``python -m``
# (``pkg.train``), or a function (``pkg.train:main``).
_MODULE = r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*"
_ENTRYPOINT = re.compile(rf"^(?:[^\x00\s:][^\x00:]*\.py|{_MODULE}(?::[A-Za-z_][A-Za-z0-9_]*)?)$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Names the launcher owns (identity, rendezvous, our own settings) or that look like secrets: secrets
# reach the job only through its token file / Kubernetes Secret, never as a plain spec value.
_RESERVED_ENV = re.compile(r"^(UNBROKEN_|TORCHELASTIC_|RANK$|LOCAL_RANK$|WORLD_SIZE$|LOCAL_WORLD_SIZE$|GROUP_RANK$|"
                           r"MASTER_ADDR$|MASTER_PORT$|PYTHONPATH$)")
# What "looks like a secret" in a name: refused in spec.env and in a Kubernetes wrapper (manifests).
SECRET_ENV = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|PRIVATE_KEY|API_KEY|ACCESS_KEY)", re.I)
DRILLS_FOR_USER_CODE = ("exception", "hang", "sigkill")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


class SpecError(ValueError):
    def __init__(self, errors: dict[str, str]):
        super().__init__("; ".join(f"{k}: {v}" for k, v in errors.items()))
        self.errors = errors


@dataclass(kw_only=True, slots=True, frozen=True)
class Drill:
    """Inject ``fault`` into ``rank`` when training reaches ``step`` (once per job)."""

    step: int
    fault: str
    rank: int = 0
    # slow_rank only: the extra share of each step the rank spends busy from ``step`` on (0.3 = 30 % slower).
    fraction: float = 0.3

    def as_flag(self) -> str:
        if self.fault == DrillFault.SLOW_RANK:
            return f"{self.step}:{self.fault}:{self.rank}:{self.fraction:g}"
        return f"{self.step}:{self.fault}:{self.rank}"


@dataclass(kw_only=True, slots=True, frozen=True)
class KubernetesSpec:
    namespace: str = "unbroken"
    image: str = "ghcr.io/unbroken/trainer:latest"
    gpus_per_node: int = 8
    efa_per_node: int = 32
    checkpoint_claim: str = "fsx-checkpoints"
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    use_jobset: bool = False
    # The nvidia-resiliency-ext release in ``image`` (e.g. "0.4.1"); preflight checks the resilience
    # flags against it. "" = unknown, not checked.
    nvrx_version: str = ""
    image_pull_policy: str = "IfNotPresent"
    # A wrapper the container runs our launcher under, e.g. ["bash", "-c", "source /env.sh && exec \"$@\"",
    # "--"]: it must exec its arguments, so the launcher still receives SIGTERM. Empty: the launcher is PID 1.
    command: list[str] = field(default_factory=list)
    # Secrets of the namespace (the user's: HF token, W&B key) mounted read-only as files at
    # /var/run/secrets/user/<name>/<key>: secrets never go in the spec's env.
    secrets: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        errors: dict[str, str] = {}
        for name, kind in (("namespace", str), ("image", str), ("checkpoint_claim", str), ("nvrx_version", str),
                           ("image_pull_policy", str), ("gpus_per_node", int), ("efa_per_node", int),
                           ("use_jobset", bool), ("node_selector", dict), ("tolerations", list),
                           ("command", list), ("secrets", list)):
            value = getattr(self, name)
            if type(value) is not kind:
                errors[f"kubernetes.{name}"] = {str: "must be a string", int: "must be an integer",
                                                bool: "must be true or false", dict: "must be an object",
                                                list: "must be a list"}[kind]
        if errors:
            raise SpecError(errors)
        if not self.image.strip():
            errors["kubernetes.image"] = "name the trainer image, e.g. 123456789012.dkr.ecr.us-east-1.amazonaws.com/trainer:1"
        for name in ("gpus_per_node", "efa_per_node"):
            if getattr(self, name) < 0:
                errors[f"kubernetes.{name}"] = "must be 0 or more"
        if not _DNS_SUBDOMAIN.match(self.checkpoint_claim):
            errors["kubernetes.checkpoint_claim"] = ("must name a PersistentVolumeClaim (ReadWriteMany, e.g. FSx for "
                                                     "Lustre) in the namespace: lowercase letters, digits, '-', '.'")
        if self.image_pull_policy not in ("Always", "IfNotPresent", "Never"):
            errors["kubernetes.image_pull_policy"] = "must be Always, IfNotPresent or Never"
        if not all(type(k) is str and type(v) is str for k, v in self.node_selector.items()):
            errors["kubernetes.node_selector"] = "must map label names to string values"
        if not all(type(c) is str and c and "\x00" not in c for c in self.command):
            errors["kubernetes.command"] = "must be a list of non-empty strings (a wrapper that execs its arguments)"
        if not all(type(n) is str and _DNS_SUBDOMAIN.match(n) for n in self.secrets) or len(self.secrets) > 16 \
                or len(set(self.secrets)) < len(self.secrets):
            errors["kubernetes.secrets"] = "must name up to 16 different Secrets of the namespace (lowercase, '-', '.')"
        if not all(type(t) is dict for t in self.tolerations):
            errors["kubernetes.tolerations"] = "must be a list of toleration objects (key, operator, value, effect)"
        if errors:
            raise SpecError(errors)


@dataclass(kw_only=True, slots=True, frozen=True)
class JobSpec:
    backend: str = "local"
    nodes: int = 1
    procs_per_node: int = 2
    preset: str = "tiny"
    steps: int = 300
    checkpoint_interval: int = 20
    checkpoint_mode: str = "async"
    keep_checkpoints: int = 3
    # Each rank also keeps a copy of its newest async save in the node's shared memory
    # (``LOCAL_CHECKPOINT_ROOT``): the new processes of an in-job restart load it instead of the
    # durable checkpoint (a network volume on Kubernetes). A copy that would not fit is skipped.
    local_checkpoint_copy: bool = True
    # Resilience layers
    in_process: bool = True
    in_job: bool = True
    job_restart: bool = True
    max_in_process_restarts: int = 10
    max_in_job_restarts: int = 5
    max_job_restarts: int = 3
    # NVRx 0.6+: ft_launcher stops restarting after this many in-job restarts in a row without a newer
    # durable checkpoint (0: off). Checked against the trainer's NVRx before launch.
    max_no_progress_restarts: int = 0
    # Supervision
    heartbeat_interval_s: float = 1.0
    step_timeout_s: float = 30.0
    checkpoint_timeout_s: float = 300.0
    stall_timeout_s: float = 120.0
    storm_restarts: int = 5
    # Stragglers: a rank whose own work per step, averaged over the window, is more than this many percent
    # above the median of the other ranks' is marked a straggler (0: off). See jobs/health.py.
    straggler_margin_pct: float = 20.0
    straggler_window_s: float = 5.0
    # One node agent per node (trainer/agent.py) relays the node's ranks' reports as one request per
    # interval; the ranks post directly when it is away. Unset in the API's spec: on past one node.
    node_agent: bool = False
    # Fork each rank from a warm fork server (trainer/preload.py): an in-job restart's new ranks skip
    # ~2 s of imports, but measured here forked ranks' steps ran ~8 % slower than fresh processes'
    # (README, "Warm ranks"): worth it only where in-job restarts come every ~25 s.
    fork_ranks: bool = False
    drills: tuple[Drill, ...] = ()
    # Rules from a fault (class, exit code, signal, pod reason) to an action; none: each layer's default.
    # See trainer/policy.py and the README, "Failure policies".
    failure_policy: tuple[Rule, ...] = ()
    kubernetes: KubernetesSpec | None = None
    # The user's own training code ("" = the built-in example model, ``preset``). See the README,
    # "Bring your own training script".
    entrypoint: str = ""
    args: tuple[str, ...] = ()
    working_dir: str = ""  # local: an absolute directory on this machine; kubernetes: the container's
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        errors: dict[str, str] = {}

        def positive(name: str, lo: float = 1) -> None:
            if getattr(self, name) < lo:
                errors[name] = f"must be at least {lo}"

        if self.backend not in BACKENDS:
            errors["backend"] = f"must be one of {', '.join(BACKENDS)}"
        if self.preset not in PRESETS:
            errors["preset"] = f"must be one of {', '.join(PRESETS)}"
        if self.checkpoint_mode not in CHECKPOINT_MODES:
            errors["checkpoint_mode"] = "must be sync or async"
        for name in ("nodes", "procs_per_node", "steps", "checkpoint_interval", "keep_checkpoints",
                     "storm_restarts"):
            positive(name)
        for name in ("max_in_process_restarts", "max_in_job_restarts", "max_job_restarts",
                     "max_no_progress_restarts"):
            positive(name, 0)
        for name in ("heartbeat_interval_s", "step_timeout_s", "checkpoint_timeout_s", "stall_timeout_s"):
            positive(name, 0.1)
        if self.straggler_margin_pct != 0 and not 5 <= self.straggler_margin_pct <= 1000:
            errors["straggler_margin_pct"] = ("must be 0 (off) or within 5..1000 percent: below 5 %, ordinary "
                                              "step-to-step noise would mark ranks")
        if not 1 <= self.straggler_window_s <= 600:
            errors["straggler_window_s"] = "must be within 1..600 seconds"
        if self.step_timeout_s < 2 * self.heartbeat_interval_s:
            errors["step_timeout_s"] = "must be at least twice heartbeat_interval_s, or every beat looks late"
        if self.backend == "local" and self.nodes != 1:
            errors["nodes"] = "the local backend runs on this machine: use 1 node, or the kubernetes backend"
        if self.backend == "kubernetes" and self.kubernetes is None:
            errors["kubernetes"] = "the kubernetes backend needs its settings (namespace, image, ...)"
        if self.kubernetes is not None and not _DNS_LABEL.match(self.kubernetes.namespace or ""):
            errors["kubernetes.namespace"] = "must be a DNS label (lowercase letters, digits, '-')"
        hard = _TRAINER_HARD_TIMEOUT_S
        if self.in_process and self.in_job and not self.step_timeout_s > hard:
            errors["step_timeout_s"] = (f"must be more than {hard:g} s, the in-process layer's hard timeout: "
                                        "ft_launcher must not end a rank the in-process layer can still restart")
        errors.update(self._user_code_errors())
        try:
            parse_rules(list(self.failure_policy), in_process=self.in_process, in_job=self.in_job,
                        job_restart=self.job_restart)
        except PolicyError as e:
            errors.update(e.errors)
        for i, d in enumerate(self.drills):
            if d.fault not in DrillFault.__members__.values():
                errors[f"drills[{i}].fault"] = f"must be one of {', '.join(f.value for f in DrillFault)}"
            elif not 0 <= d.rank < self.world_size:
                errors[f"drills[{i}].rank"] = f"must be a rank of this job: 0..{self.world_size - 1}"
            elif not 0 < d.step < self.steps:
                errors[f"drills[{i}].step"] = f"must be within 1..{self.steps - 1} (before the last step)"
            elif type(d.fraction) not in (int, float) or not 0 < d.fraction <= 10:
                errors[f"drills[{i}].fraction"] = "must be a number within 0..10 (0.3: the rank is 30 % slower)"
            elif self.entrypoint and not self.in_process and d.fault not in DRILLS_FOR_USER_CODE:
                errors[f"drills[{i}].fault"] = (f"your own script can be drilled with {', '.join(DRILLS_FOR_USER_CODE)} "
                                                "(fired when it reports that step); nan_loss, hang_collective and "
                                                "slow_rank need the SDK's entrypoint function with in-process restarts on")
        if errors:
            raise SpecError(errors)

    def _user_code_errors(self) -> dict[str, str]:
        errors: dict[str, str] = {}
        if self.entrypoint and not _ENTRYPOINT.match(self.entrypoint):
            errors["entrypoint"] = ("name a script (train.py, src/train.py), a module (pkg.train) or a function "
                                    "(pkg.train:main)")
        if not all(type(a) is str and "\x00" not in a for a in self.args):
            errors["args"] = "must be a list of strings"
        elif len(self.args) > 256 or sum(map(len, self.args)) > 16384:
            errors["args"] = "at most 256 arguments and 16 KiB in all"
        elif self.args and not self.entrypoint:
            errors["args"] = "arguments go to your own script: set entrypoint too"
        if self.working_dir and (type(self.working_dir) is not str or not self.working_dir.startswith("/")
                                 or "\x00" in self.working_dir):
            errors["working_dir"] = "must be an absolute directory path, e.g. /home/me/project"
        bad = [k for k, v in self.env.items() if type(k) is not str or not _ENV_NAME.match(k) or type(v) is not str
               or "\x00" in v]
        reserved = [k for k in self.env if type(k) is str and _RESERVED_ENV.match(k)]
        secret = [k for k in self.env if type(k) is str and SECRET_ENV.search(k)]
        if bad:
            errors["env"] = f"names must be like MY_VAR and values strings: {', '.join(map(str, bad[:3]))}"
        elif reserved:
            errors["env"] = f"{', '.join(reserved[:3])}: set by the launcher, not by the spec"
        elif secret:
            errors["env"] = (f"{', '.join(secret[:3])} looks like a secret: specs are stored and shown in plain "
                             "text; put secrets in a file the script reads or a Kubernetes Secret")
        elif len(self.env) > 128 or sum(len(k) + len(v) for k, v in self.env.items()) > 32768:
            errors["env"] = "at most 128 variables and 32 KiB in all"
        return errors

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

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobSpec:
        """Build from JSON-like data (the API, the form, the stored column); unknown keys are errors."""
        if not isinstance(data, dict):
            raise SpecError({"spec": "must be an object"})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise SpecError({k: "unknown field" for k in unknown})
        kwargs = dict(data)
        try:
            if "drills" in kwargs:
                kwargs["drills"] = tuple(Drill(**d) if isinstance(d, dict) else d for d in kwargs["drills"] or ())
            if isinstance(kwargs.get("kubernetes"), dict):
                kwargs["kubernetes"] = KubernetesSpec(**kwargs["kubernetes"])
            if "failure_policy" in kwargs:
                kwargs["failure_policy"] = parse_rules(kwargs["failure_policy"])
            if isinstance(kwargs.get("args"), list):
                kwargs["args"] = tuple(kwargs["args"])
            if "node_agent" not in kwargs and type(kwargs.get("nodes")) is int and kwargs["nodes"] > 1:
                kwargs["node_agent"] = True  # one request per node where there are several: make bench-fleet
            if kwargs.get("entrypoint") and "in_process" not in kwargs:
                kwargs["in_process"] = False  # re-enters only an SDK entrypoint function: opt in
        except PolicyError as e:
            raise SpecError(e.errors) from None
        except TypeError as e:
            raise SpecError({"drills" if "Drill" in str(e) else "kubernetes": str(e)}) from None
        _check_types(cls, kwargs)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["failure_policy"] = [r.to_dict() for r in self.failure_policy]
        return out


def _check_types(cls: type, kwargs: dict[str, Any]) -> None:
    """Reject wrong JSON types up front (a string where a number belongs), naming the field."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    errors = {}
    for k, v in kwargs.items():
        d = defaults.get(k)
        if isinstance(d, bool):
            if type(v) is not bool:
                errors[k] = "must be true or false"
        elif isinstance(d, int):
            if type(v) is not int:
                errors[k] = "must be an integer"
        elif isinstance(d, float):
            if type(v) not in (int, float):
                errors[k] = "must be a number"
        elif isinstance(d, str) and type(v) is not str:
            errors[k] = "must be a string"
        elif k == "args" and type(v) is not tuple:
            errors[k] = "must be a list of strings"
        elif k == "env" and type(v) is not dict:
            errors[k] = "must be an object of NAME: value strings"
    if errors:
        raise SpecError(errors)


# The demo runs for several minutes (about 5 on a laptop CPU, at ~5 steps/s) so a newcomer can try a
# manual restart and a fault injection while it runs; its two drills come about a fifth and three fifths
# of the way in. The README's API example starts the same job.
DEMO_SPEC = JobSpec(
    preset="tiny",
    steps=1500,
    checkpoint_interval=20,
    step_timeout_s=20.0,
    stall_timeout_s=60.0,
    drills=(Drill(step=300, fault="exception", rank=1), Drill(step=900, fault="sigkill", rank=0)),
)
