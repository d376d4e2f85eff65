"""A job's spec: what to run and how to keep it alive. Validated once, stored as JSON on the Job.

Errors are ``SpecError``s keyed by field name, so forms and the API can show them next to the field.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from trainer.wire import DrillFault

PRESETS = ("tiny", "small", "1b")
BACKENDS = ("local", "kubernetes")
CHECKPOINT_MODES = ("sync", "async")
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

    def as_flag(self) -> str:
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

    def __post_init__(self) -> None:
        errors: dict[str, str] = {}
        for name, kind in (("namespace", str), ("image", str), ("checkpoint_claim", str), ("nvrx_version", str),
                           ("image_pull_policy", str), ("gpus_per_node", int), ("efa_per_node", int),
                           ("use_jobset", bool), ("node_selector", dict), ("tolerations", list)):
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
    # Resilience layers
    in_process: bool = True
    in_job: bool = True
    job_restart: bool = True
    max_in_process_restarts: int = 10
    max_in_job_restarts: int = 5
    max_job_restarts: int = 3
    # Supervision
    heartbeat_interval_s: float = 1.0
    step_timeout_s: float = 30.0
    checkpoint_timeout_s: float = 300.0
    stall_timeout_s: float = 120.0
    storm_restarts: int = 5
    drills: tuple[Drill, ...] = ()
    kubernetes: KubernetesSpec | None = None

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
        for name in ("max_in_process_restarts", "max_in_job_restarts", "max_job_restarts"):
            positive(name, 0)
        for name in ("heartbeat_interval_s", "step_timeout_s", "checkpoint_timeout_s", "stall_timeout_s"):
            positive(name, 0.1)
        if self.step_timeout_s < 2 * self.heartbeat_interval_s:
            errors["step_timeout_s"] = "must be at least twice heartbeat_interval_s, or every beat looks late"
        if self.backend == "local" and self.nodes != 1:
            errors["nodes"] = "the local backend runs on this machine: use 1 node, or the kubernetes backend"
        if self.backend == "kubernetes" and self.kubernetes is None:
            errors["kubernetes"] = "the kubernetes backend needs its settings (namespace, image, ...)"
        if self.kubernetes is not None and not _DNS_LABEL.match(self.kubernetes.namespace or ""):
            errors["kubernetes.namespace"] = "must be a DNS label (lowercase letters, digits, '-')"
        for i, d in enumerate(self.drills):
            if d.fault not in DrillFault.__members__.values():
                errors[f"drills[{i}].fault"] = f"must be one of {', '.join(f.value for f in DrillFault)}"
            elif not 0 <= d.rank < self.world_size:
                errors[f"drills[{i}].rank"] = f"must be a rank of this job: 0..{self.world_size - 1}"
            elif not 0 < d.step < self.steps:
                errors[f"drills[{i}].step"] = f"must be within 1..{self.steps - 1} (before the last step)"
        if errors:
            raise SpecError(errors)

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

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
        except TypeError as e:
            raise SpecError({"drills" if "Drill" in str(e) else "kubernetes": str(e)}) from None
        _check_types(cls, kwargs)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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
    if errors:
        raise SpecError(errors)


DEMO_SPEC = JobSpec(
    preset="tiny",
    steps=400,
    checkpoint_interval=20,
    step_timeout_s=20.0,
    stall_timeout_s=60.0,
    drills=(Drill(step=60, fault="exception", rank=1), Drill(step=150, fault="sigkill", rank=0)),
)
