"""The user-code side without a control plane: progress lines, the shim's argv and entrypoint forms,
the launcher's checks of a user's script, and the SDK outside the product."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import unbroken
from trainer.launch import check_entrypoint, launcher_args, parse
from trainer.progress_lines import parse_progress
from trainer.shim import split_argv

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "trainer" / "examples"


@pytest.mark.parametrize("line, expected", [
    ("step 12 loss 0.5", (12, 0.5)),
    ("Step=7, Loss: 1e-3", (7, 0.001)),
    ("[rank0] epoch 1 step: 300 lr 3e-4 loss=nan", (300, None)),  # NaN parses; float('nan') != itself
    ('UNBROKEN {"step": 40, "loss": 2}', (40, 2.0)),
    ("resumed from step 60", (60, None)),
    ("global_step 5", None),
    ("no progress here", None),
    ('UNBROKEN {"step": -1}', None),
    ("UNBROKEN not json", None),
])
def test_it_reads_progress_lines(line, expected):
    got = parse_progress(line)
    if expected is not None and expected[1] is None and got is not None and got[1] is not None:
        assert got[0] == expected[0] and got[1] != got[1]  # NaN
        return
    assert got == expected


def test_it_splits_the_shims_argv():
    assert split_argv(["--run-dir", "/r", "--", "train.py", "--lr", "1", "--"]) == (
        ["--run-dir", "/r"], "train.py", ["--lr", "1", "--"])
    with pytest.raises(ValueError, match="no entrypoint"):
        split_argv(["--run-dir", "/r", "--"])


def test_it_passes_the_users_code_and_arguments_to_every_rank():
    ns, targs, cfg = parse(["--nproc-per-node", "2", "--run-dir", "/tmp/x", "--entrypoint", "train.py", "--",
                            "--no-in-process", "--", "--steps", "10", "--", "x"])
    args = launcher_args(ns, cfg, targs)
    i = args.index("-m")
    assert args[i:] == ["-m", "trainer.standby", "--no-in-process", "--run-dir", "/tmp/x", "--", "train.py",
                        "--steps", "10", "--", "x"]
    with pytest.raises(ValueError, match="no such directory"):
        parse(["--run-dir", "/tmp/x", "--entrypoint", "t.py", "--workdir", "/nonexistent", "--", "--no-in-process"])


def test_it_finds_code_that_cannot_start_before_any_rank_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ok.py").write_text("import os\n")
    (tmp_path / "bad.py").write_text("def f(:\n")
    assert check_entrypoint("ok.py") == ""
    assert "does not compile" in check_entrypoint("bad.py") and "line 1" in check_entrypoint("bad.py")
    assert "does not exist" in check_entrypoint("gone.py")
    assert "no module 'nowhere_pkg'" in check_entrypoint("nowhere_pkg.train:main")
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    assert check_entrypoint("mypkg.train:main") == ""


def test_the_sdk_does_nothing_outside_the_product():
    run = unbroken.init()
    assert not run.active and not run.stop_requested()
    run.step(1, loss=0.5)
    with run.phase("eval"):
        pass
    with pytest.raises(ValueError, match="choose one of"):
        run.phase("lunch")
    assert unbroken.checkpoint_dir() is None or isinstance(unbroken.checkpoint_dir(), str)


def test_the_examples_import_only_the_public_sdk():
    public = set(unbroken.__all__)
    for path in EXAMPLES.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith(("trainer", "unbroken.")), f"{path.name}: {node.module}"
                if node.module == "unbroken":
                    assert {a.name for a in node.names} <= public, path.name
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("trainer") for a in node.names), path.name
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "unbroken":
                assert node.attr in public, f"{path.name}: unbroken.{node.attr}"


def test_the_level1_example_is_the_plain_script_plus_a_few_lines():
    plain = {line.strip() for line in (EXAMPLES / "plain_fsdp.py").read_text().splitlines()}
    level1 = [line.strip() for line in (EXAMPLES / "fsdp_level1.py").read_text().split('"""', 2)[2].splitlines()]
    added = [line for line in level1 if line and line not in plain]
    assert all("unbroken" in line or "run." in line or line == "break" for line in added), added
    assert len(added) <= 10, added


def test_the_sdk_installs_as_its_own_distribution(tmp_path):
    """``pip install ./trainer`` gives ``import unbroken`` without the control plane (no Django)."""
    import shutil

    src, target = tmp_path / "src", tmp_path / "site"  # a copy: an in-tree build would leave build/ behind
    shutil.copytree(ROOT / "trainer", src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--target", str(target), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (target / "unbroken" / "__init__.py").exists() and (target / "trainer" / "shim.py").exists()
    assert not (target / "controlplane").exists()
    code = "import sys, unbroken; assert 'django' not in sys.modules; print(unbroken.init().active)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                       env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr[-2000:]
    # What the launcher and the ranks import at module level comes with the distribution (NVRx, the
    # extra, is imported only where a job turns its layers on, behind a clear error).
    meta = next(target.glob("unbroken_sdk-*.dist-info")) / "METADATA"
    required = {line.split(":", 1)[1].strip().split(";")[0].split(">")[0].split("=")[0].strip().lower()
                for line in meta.read_text().splitlines()
                if line.startswith("Requires-Dist:") and "extra ==" not in line}
    imported = set()
    for py in (target / "trainer").glob("*.py"):
        for node in ast.parse(py.read_text()).body:
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level
                     else [])
            imported |= {n.split(".")[0] for n in names}
    third_party = imported - set(sys.stdlib_module_names) - {"trainer", "unbroken", "__future__"}
    assert third_party <= required, f"imported but not required: {third_party - required}"
    assert "psutil" in required


def test_the_heartbeat_thread_leaves_a_command_to_the_full_level_once_the_rank_has_reached_it(tmp_path, monkeypatch):
    """The heartbeat thread (Level 0) reads the level, then takes a command; the main thread can reach an
    ``unbroken.entrypoint`` function in between. A command taken then was marked done for a peer that no
    longer looks at its own inbox (rank 0 skipped an inject_fault aimed at rank 1: never acted on, never
    acknowledged). It stays for the SDK's loop, which agrees on it across ranks."""
    from trainer.config import TrainConfig
    from trainer.reporter import NullReporter
    from trainer.runtime import RankEnv
    from trainer.usercode import UserRun

    monkeypatch.setenv("RANK", "0")
    env = RankEnv(initial_rank=0, world_size=2, local_rank=0, restart_count=0, store_host="127.0.0.1",
                  app_store_port=0, wrapper_store_port=0, stores_external=False, in_job=False)
    inject = {"id": 1, "kind": "inject_fault", "level": None, "rank": 1, "fault": "exception", "issued_at": 0.0}

    def level0_run(name: str) -> UserRun:
        (tmp_path / name).mkdir()
        run = UserRun(cfg=TrainConfig(run_dir=str(tmp_path / name)), env=env, entrypoint="train:main",
                      reporter=NullReporter())
        run.inbox.offer([inject])
        run.progress(1, None)  # a printed step: Level 0 acts on commands from here on
        return run

    still_level0 = level0_run("a")
    still_level0._commands(level=0)
    assert still_level0.inbox.peek() is None  # Level 0: each rank takes it (rank 1 acts and acknowledges)

    moved_on = level0_run("b")
    moved_on.upgrade(2)
    moved_on._commands(level=0)  # the heartbeat thread, having read level 0 before the upgrade
    assert moved_on.inbox.peek() == inject
