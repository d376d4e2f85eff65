"""Where and how the pods of a ``kubernetes`` job run: the ``kubernetes`` part of a job's spec
(``trainer.jobspec.JobSpec.kubernetes``). Standard library and msgspec only.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

from trainer.spec_errors import SpecError
from trainer.spec_errors import described as _d

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


class KubernetesSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where and how the pods of a ``kubernetes`` job run."""

    namespace: Annotated[str, _d("the namespace of the job's pods (a DNS label)")] = "unbroken"
    image: Annotated[str, _d("the trainer image (it has ``pip install ./trainer`` and torch)")] = (
        "ghcr.io/unbroken/trainer:latest"
    )
    gpus_per_node: Annotated[int, _d("nvidia.com/gpu requested per pod", ge=0, le=1024)] = 8
    efa_per_node: Annotated[int, _d("vpc.amazonaws.com/efa interfaces requested per pod", ge=0, le=1024)] = 32
    checkpoint_claim: Annotated[
        str, _d("a ReadWriteMany PersistentVolumeClaim for checkpoints (e.g. FSx for Lustre)")
    ] = "fsx-checkpoints"
    node_selector: Annotated[dict[str, str], _d("the pods' node selector")] = msgspec.field(
        default_factory=dict
    )
    tolerations: Annotated[list[dict[str, Any]], _d("the pods' tolerations")] = msgspec.field(
        default_factory=list
    )
    use_jobset: Annotated[bool, _d("a JobSet (one Job per node) instead of one Indexed Job")] = False
    nvrx_version: Annotated[
        str,
        _d(
            "the nvidia-resiliency-ext release in ``image`` (e.g. 0.4.1); preflight "
            "checks the resilience settings against it; empty: not checked"
        ),
    ] = ""
    image_pull_policy: Annotated[
        Literal["Always", "IfNotPresent", "Never"], _d("the pods' image pull policy")
    ] = "IfNotPresent"
    command: Annotated[
        list[str],
        _d(
            'a wrapper the container runs the launcher under, e.g. ["bash", "-c", '
            '"source /env.sh && exec \\"$@\\"", "--"]: it must exec its '
            "arguments; empty: the launcher is PID 1"
        ),
    ] = msgspec.field(default_factory=list)
    secrets: Annotated[
        list[str],
        _d(
            "Secrets of the namespace mounted read-only at "
            "/var/run/secrets/user/<name>/<key> (secrets never go in env)"
        ),
    ] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        errors: dict[str, str] = {}
        if not self.image.strip():
            errors["kubernetes.image"] = (
                "name the trainer image, e.g. 123456789012.dkr.ecr.us-east-1.amazonaws.com/trainer:1"
            )
        for name in ("gpus_per_node", "efa_per_node"):
            if getattr(self, name) < 0:
                errors[f"kubernetes.{name}"] = "must be 0 or more"
        if not _DNS_SUBDOMAIN.match(self.checkpoint_claim):
            errors["kubernetes.checkpoint_claim"] = (
                "must name a PersistentVolumeClaim (ReadWriteMany, e.g. FSx for "
                "Lustre) in the namespace: lowercase letters, digits, '-', '.'"
            )
        if self.image_pull_policy not in ("Always", "IfNotPresent", "Never"):
            errors["kubernetes.image_pull_policy"] = "must be Always, IfNotPresent or Never"
        if not all(type(k) is str and type(v) is str for k, v in self.node_selector.items()):
            errors["kubernetes.node_selector"] = "must map label names to string values"
        if not all(type(c) is str and c and "\x00" not in c for c in self.command):
            errors["kubernetes.command"] = (
                "must be a list of non-empty strings (a wrapper that execs its arguments)"
            )
        if (
            not all(type(n) is str and _DNS_SUBDOMAIN.match(n) for n in self.secrets)
            or len(self.secrets) > 16
            or len(set(self.secrets)) < len(self.secrets)
        ):
            errors["kubernetes.secrets"] = (
                "must name up to 16 different Secrets of the namespace (lowercase, '-', '.')"
            )
        if not all(type(t) is dict for t in self.tolerations):
            errors["kubernetes.tolerations"] = (
                "must be a list of toleration objects (key, operator, value, effect)"
            )
        if not _DNS_LABEL.match(self.namespace or ""):
            errors["kubernetes.namespace"] = "must be a DNS label (lowercase letters, digits, '-')"
        if errors:
            raise SpecError(errors)
