"""The warm fork server's preload: what every rank imports anyway, and never the user's own modules."""

import json
import textwrap

from tests.trainer.conftest import launch
from trainer import preload

SCRIPT = textwrap.dedent("""\
    import json
    import os
    import sys

    import torch
    from torch.distributed import checkpoint

    import mylib
    from . import nothing_relative  # noqa - never reached: a relative import is not read

    def later():
        import email  # inside a function: not a top-level import
""")


def test_it_reads_the_scripts_top_level_imports_of_installed_modules(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "mylib.py").write_text("raise SystemExit('imported')\n")
    assert preload.entrypoint_imports("train.py", str(tmp_path)) == [
        "json", "os", "sys", "torch", "torch.distributed"]


def test_it_finds_a_modules_source_without_running_its_package(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise SystemExit('the package ran')\n")
    (pkg / "train.py").write_text("import fractions\nimport pkg.helpers\n")
    assert preload.entrypoint_imports("pkg.train:main", str(tmp_path)) == ["fractions"]
    (pkg / "__main__.py").write_text("import decimal\n")
    assert preload.entrypoint_imports("pkg", str(tmp_path)) == ["decimal"]
    assert preload.entrypoint_imports("missing.mod:main", str(tmp_path)) == []
    (tmp_path / "broken.py").write_text("def (:\n")
    assert preload.entrypoint_imports("broken.py", str(tmp_path)) == []


def test_the_sdk_modules_come_first_and_the_scripts_part_can_be_turned_off(tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text("import fractions\nimport torch\n")
    got = preload.modules_for("train.py", str(tmp_path))
    assert got[:len(preload.SDK_MODULES)] == list(preload.SDK_MODULES)
    assert got[len(preload.SDK_MODULES):] == ["fractions", "torch"]
    monkeypatch.setenv("UNBROKEN_PRELOAD", "0")
    assert preload.modules_for("train.py", str(tmp_path)) == list(preload.SDK_MODULES)


def test_a_module_that_fails_to_import_is_left_to_the_rank():
    assert preload.warm("fractions, no_such_module_here,,decimal") == ["no_such_module_here"]


PROBE = textwrap.dedent("""\
    import json, os, sys
    # What the fork server had imported before this rank was forked from it (nothing of ours ran yet).
    warm = sorted(m for m in sys.argv[1:] if m in sys.modules)
    with open(os.path.join(os.environ["UNBROKEN_RUN_DIR"], f"probe{os.environ['RANK']}.json"), "w") as f:
        f.write(json.dumps({"warm": warm}))

    import fractions
    import mylib
""")


def test_ranks_forked_from_the_server_start_with_the_modules_imported_and_run_the_users_own_themselves(tmp_path):
    """A real launch (ft_launcher, ranks forked from the warm fork server) of an unmodified script: the
    script sees FSDP2, the dynamo import its first fully_shard makes and its own installed imports already
    loaded; its own module is imported by each rank (with the rank's environment), never by the server."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "probe.py").write_text(PROBE)
    (work / "mylib.py").write_text(textwrap.dedent("""\
        import os
        with open(os.path.join(os.environ["UNBROKEN_RUN_DIR"], "mylib_imports"), "a") as f:
            f.write(f"{os.getpid()} {os.environ.get('RANK')}\\n")
    """))
    run_dir = tmp_path / "run"
    r = launch(run_dir, trainer_flags=["--no-in-process", "--steps", "10"], entrypoint=str(work / "probe.py"),
               user_args=["torch._dynamo", "torch.distributed.fsdp", "fractions", "mylib_not_yet"],
               env={"UNBROKEN_RUN_DIR": str(run_dir), "UNBROKEN_FORK_RANKS": "1"}, timeout_s=240)
    assert r.rc == 0, r.log[-3000:]
    for rank in (0, 1):
        probe = json.loads((run_dir / f"probe{rank}.json").read_text())
        assert probe["warm"] == ["fractions", "torch._dynamo", "torch.distributed.fsdp"], probe
    lines = (run_dir / "mylib_imports").read_text().split()
    assert sorted(lines[1::2]) == ["0", "1"], lines  # once per rank, each with its RANK
