"""The main thread's stack, taken from another thread (a hang's evidence): traceback's layout, the
innermost frames, redacted."""

import re
import threading

from trainer.redaction import REDACTED
from trainer.stacks import MAX_FRAMES, in_collective, main_thread_stack


def test_it_takes_the_main_threads_innermost_frames_in_tracebacks_layout_redacted():
    got = {}
    ready, done = threading.Event(), threading.Event()

    def taker():
        ready.wait(5)
        got["stack"] = main_thread_stack(("value-of-secret-42",))
        done.set()

    threading.Thread(target=taker, daemon=True).start()

    def waiting_main_thread():
        ready.set(); done.wait(5)  # value-of-secret-42  # noqa: E702

    waiting_main_thread()
    stack = got["stack"]
    head, *lines = stack.splitlines()
    assert head == "Stack of the main thread (most recent call last):"
    files = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    assert len(files) == MAX_FRAMES  # pytest's stack is deeper: the innermost 12
    assert all(re.fullmatch(r'  File ".+", line \d+, in [\w<>]+', lines[i]) for i in files)
    assert all(lines[i].startswith("    ") for i in range(len(lines)) if i not in files)
    mine = next(i for i in files if lines[i].endswith("in waiting_main_thread"))
    assert 'test_stacks.py", line ' in lines[mine]
    assert lines[mine + 1] == f"    ready.set(); done.wait(5)  # {REDACTED}  # noqa: E702"
    assert re.search(r'threading\.py", line \d+, in wait$', lines[files[-1]])  # innermost: the Event's wait
    assert "value-of-secret-42" not in stack and not in_collective(stack)
