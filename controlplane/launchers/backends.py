"""The launcher backends by name (kept apart from ``base``, which the backends import)."""

from __future__ import annotations

from controlplane.launchers.base import Launcher, LaunchError


def get_launcher(backend: str) -> Launcher:
    if backend == "local":
        from controlplane.launchers.local import LocalLauncher

        return LocalLauncher()
    if backend == "kubernetes":
        from controlplane.launchers.kubernetes import KubernetesLauncher

        return KubernetesLauncher.from_settings()
    raise LaunchError(f"unknown backend {backend!r}: use local or kubernetes")
