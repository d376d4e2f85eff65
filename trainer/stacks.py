"""What a rank can say about its own fault, taken without stopping the loop: its exception's traceback,
and the main thread's Python stack (taken from another thread when the main one is hung: the in-process
layer's monitor thread, at abort). Both are capped and redacted (``wire.redact``) before they leave the
rank. Taking a stack is ``sys._current_frames`` plus formatting, on the calling thread: the main thread
is never paused (``make bench-straggler`` measures the step time it adds, ``evidence_ms``).
"""

from __future__ import annotations

import linecache
import re
import sys
import threading
import traceback
from types import FrameType

from trainer.wire import MAX_EVIDENCE_CHARS, redact

MAX_FRAMES = 12
# A stack (traceback's or faulthandler's format) inside a collective call: the rank waits for a peer. Of the
# ranks of a hang, the one whose loop stopped elsewhere is the hung one.
COLLECTIVE_FRAME = re.compile(r'distributed_c10d\.py", line \d+,? in \w+')


def in_collective(stack: str) -> bool:
    return bool(COLLECTIVE_FRAME.search(stack))


def _cap(text: str) -> str:
    return text if len(text) <= MAX_EVIDENCE_CHARS else "...\n" + text[-(MAX_EVIDENCE_CHARS - 4):]


def exception_text(exc: BaseException, secrets: tuple[str, ...] = ()) -> str:
    """The exception's traceback (its last frames), as Python prints it, redacted and capped."""
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-MAX_FRAMES)
    return _cap(redact("".join(lines).rstrip(), secrets))


def main_thread_stack(secrets: tuple[str, ...] = ()) -> str:
    """The main thread's current Python stack (innermost last), redacted and capped; "" if unavailable."""
    frame = sys._current_frames().get(threading.main_thread().ident)  # underscored, yet documented (sys docs)
    if frame is None:
        return ""
    return _cap(redact("Stack of the main thread (most recent call last):\n" + _frames_text(frame), secrets))


def _frames_text(frame: FrameType | None) -> str:
    """The innermost ``MAX_FRAMES`` frames in traceback's layout (``File "f", line N, in name`` and the
    source line), without the column carets Python 3.11+ works out by parsing each line: taken from
    another thread while the loop waits for the interpreter lock, so every 0.1 ms counts (this is half
    the cost of ``traceback.format_stack``)."""
    frames = []
    while frame is not None and len(frames) < MAX_FRAMES:
        frames.append(frame)
        frame = frame.f_back
    out = []
    for f in reversed(frames):
        code, lineno = f.f_code, f.f_lineno
        out.append(f'  File "{code.co_filename}", line {lineno}, in {code.co_name}')
        line = linecache.getline(code.co_filename, lineno, f.f_globals).strip()
        if line:
            out.append(f"    {line}")
    return "\n".join(out)
