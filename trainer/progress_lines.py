"""A script's output as the product reads it (Level 0): its progress lines, and a tee that passes the
rank's writes through, keeps them in the rank's log and hands each complete line on.

Progress lines: a line containing ``step N`` / ``step=N`` / ``step: N`` (any case) is a progress report;
``loss X`` / ``loss=X`` on the same line is its loss. ``UNBROKEN {"step": N, "loss": X}`` is the explicit
form. Only the rank's Python-level writes to ``sys.stdout`` are read (``usercode.tee_output``).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from collections.abc import Callable
from typing import Any

_STEP = re.compile(r"\bstep[\s=:]+(\d+)\b", re.IGNORECASE)
_LOSS = re.compile(r"\bloss[\s=:]+([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+|nan|inf))", re.IGNORECASE)
_EXPLICIT = "UNBROKEN "


def parse_progress(line: str) -> tuple[int, float | None] | None:
    """(step, loss) of a progress line, or None. See the module docstring for the forms."""
    if line.startswith(_EXPLICIT):
        try:
            obj = json.loads(line[len(_EXPLICIT):])
        except ValueError:
            return None
        step, loss = obj.get("step") if isinstance(obj, dict) else None, None
        if type(step) is not int or step < 0:
            return None
        if type(obj.get("loss")) in (int, float):
            loss = float(obj["loss"])
        return step, loss
    m = _STEP.search(line)
    if m is None:
        return None
    lm = _LOSS.search(line)
    return int(m.group(1)), (float(lm.group(1)) if lm else None)


class LineTee(io.TextIOBase):
    """A text stream that passes writes through and hands each complete line to ``on_line``."""

    def __init__(self, inner: Any, log_file: Any, on_line: Callable[[str], None] | None):
        self._inner, self._log, self._on_line = inner, log_file, on_line
        self._buf = ""

    def write(self, s: str) -> int:
        n = self._inner.write(s)
        with contextlib.suppress(Exception):
            self._log.write(s)
        if self._on_line is not None:
            self._buf += s
            if "\n" in self._buf:
                *lines, self._buf = self._buf.split("\n")
                self._buf = self._buf[-4096:]
                for line in lines:
                    self._on_line(line)  # may raise: a drill's injected exception surfaces in the print
        return n

    def flush(self) -> None:
        self._inner.flush()
        with contextlib.suppress(Exception):
            self._log.flush()

    def writable(self) -> bool:
        return True

    # io.TextIOBase defines these (raising or returning None), so __getattr__ would never see them.
    def fileno(self) -> int:
        return self._inner.fileno()

    def isatty(self) -> bool:
        return self._inner.isatty()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self._inner.encoding

    @property
    def errors(self) -> str | None:  # type: ignore[override]
        return self._inner.errors

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, buffer, ...
        return getattr(self._inner, name)
