"""How the dashboard writes durations, layers and commands in words, the same on every page, table, hover
and chart (the report and the API tests read them too)."""

from __future__ import annotations

from controlplane.jobs.models import LAYER_WORDS, Command

LAYER_NAMES = LAYER_WORDS


def fmt_s(v: float | None) -> str:
    if v is None:
        return "–"
    if v < 1:
        return f"{v * 1000:.0f} ms"
    if v < 120:
        return f"{v:.2f} s"
    if v < 7200:
        return f"{v / 60:.1f} min"
    return f"{v / 3600:.1f} h"


def layer_words(layer: str | None, escalated_to: str | None = None) -> str:
    if not layer:
        return ""
    return LAYER_NAMES.get(layer, layer) + (" → handed on to a later restart" if escalated_to else "")


def recovery_words(o) -> str:
    if o.recovery_s is not None:
        return fmt_s(o.recovery_s)
    return "in progress" if o.recovering else "–"


def command_summary(c: Command) -> str:
    if c.kind == "restart":
        return f"restart ({LAYER_NAMES.get(c.level, c.level)})" + (
            f" rank {c.rank}" if c.rank is not None else ""
        )
    if c.kind == "inject_fault":
        return f"inject {c.fault} into rank {c.rank}"
    return c.kind
