"""A job's spec. The type lives on the training side (``trainer.jobspec``), where the ranks decode the
same document the control plane validated and stored; this module names it for the control plane."""

from trainer.jobspec import (BACKENDS, CHECKPOINT_MODES, DEMO_SPEC, DRILLS_FOR_USER_CODE, PRESETS, SECRET_ENV,
                             Drill, JobSpec, KubernetesSpec, SpecError, reference_rows)

__all__ = ["BACKENDS", "CHECKPOINT_MODES", "DEMO_SPEC", "DRILLS_FOR_USER_CODE", "PRESETS", "SECRET_ENV", "Drill",
           "JobSpec", "KubernetesSpec", "SpecError", "reference_rows"]
