"""The ``unbroken`` command ships in the SDK's distribution (``pip install ./trainer``), the SDK does not
need its libraries, and its shell completion works."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
UNBROKEN = Path(sys.executable).with_name("unbroken")


def test_it_puts_the_command_in_the_sdks_wheel(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(ROOT / "trainer")], check=True, capture_output=True, timeout=300)
    wheel = zipfile.ZipFile(next(tmp_path.glob("unbroken_sdk-*.whl")))
    names = wheel.namelist()
    assert "trainer/cli/main.py" in names and "trainer/cli/follow.py" in names
    entry_points = wheel.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "unbroken = trainer.cli:main" in entry_points
    metadata = wheel.read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "Requires-Dist: httpx2>=2.16" in metadata and "Requires-Dist: rich" in metadata


def test_it_keeps_the_sdk_free_of_the_commands_libraries():
    code = ("import sys, unbroken, trainer.launch; "
            "print(sorted(m for m in ('click', 'rich', 'httpx2', 'django') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_it_completes_commands_in_the_shell():
    def complete(**env: str) -> str:
        return subprocess.run([str(UNBROKEN)], env={"PATH": "/usr/bin:/bin", **env}, capture_output=True,
                              text=True, timeout=60).stdout

    script = complete(_UNBROKEN_COMPLETE="bash_source")
    assert "complete -o nosort -F _unbroken_completion unbroken" in script
    words = complete(_UNBROKEN_COMPLETE="bash_complete", COMP_WORDS="unbroken re", COMP_CWORD="1")
    assert "plain,restart" in words
    levels = complete(_UNBROKEN_COMPLETE="bash_complete", COMP_WORDS="unbroken restart 3 --level ",
                      COMP_CWORD="4")
    assert levels.split() == ["plain,in_process", "plain,in_job", "plain,job"]
