"""The NVRx seam against the installed release. `make test` runs this file with each supported release
(0.4.1 from requirements.lock, then 0.6.0 from its own site directory), so every assertion is about
what *this* release accepts: the spellings we pass, what we refuse, and what we never import."""

import subprocess
import sys

import pytest

from trainer import nvrx_compat
from trainer.checkpoint_layout import write_iteration_file
from trainer.launch import launcher_args, parse

pytestmark = pytest.mark.nvrx

RUN = ["--nproc-per-node", "2", "--rdzv-endpoint", "h:29400", "--run-dir", "/tmp/unbroken-nvrx-test"]


def _release_parser():
    from nvidia_resiliency_ext.fault_tolerance import launcher

    return launcher.get_args_parser()


def test_it_runs_with_a_supported_release():
    assert nvrx_compat.version_str() in nvrx_compat.SUPPORTED


def test_every_launcher_flag_we_pass_is_this_releases_current_spelling():
    ns, targs, cfg = parse(RUN)
    args = launcher_args(ns, cfg, targs)
    own = args[:args.index("-m")]
    parser = _release_parser()
    parsed, unknown = parser.parse_known_args([*own, "-m", "trainer"])
    assert unknown == []
    deprecated = {s for a in parser._actions if "deprecat" in (a.help or "").lower() for s in a.option_strings}
    used = {a.split("=", 1)[0] for a in own}
    assert not used & deprecated, f"deprecated in NVRx {nvrx_compat.version_str()}: {used & deprecated}"


def test_it_hands_the_no_progress_check_to_releases_that_have_it():
    has_it = nvrx_compat.version() >= nvrx_compat.ONLY_FROM["max_no_progress_restarts"][0]
    if not has_it:
        with pytest.raises(ValueError) as e:
            parse(["--max-no-progress-restarts", "2", *RUN])
        assert f"this job's NVRx is {nvrx_compat.version_str()}" in str(e.value)
        assert "needs NVRx 0.6.0 or later" in str(e.value) and "--max-no-progress-restarts" in str(e.value)
        return
    ns, targs, cfg = parse(["--max-no-progress-restarts", "2", *RUN])
    args = launcher_args(ns, cfg, targs)
    assert "--ft-max-no-progress-cycles=2" in args
    assert f"--ft-checkpoint-iteration-file={cfg.ckpt_dir}/{nvrx_compat.ITERATION_FILE}" in args
    ns, targs, cfg = parse(RUN)
    assert "--ft-max-no-progress-cycles=0" in launcher_args(ns, cfg, targs)  # off, and no warning about it


def test_the_iteration_file_holds_the_newest_durable_step(tmp_path):
    write_iteration_file(str(tmp_path), 20)
    write_iteration_file(str(tmp_path), 40)
    assert (tmp_path / nvrx_compat.ITERATION_FILE).read_text() == "40\n"
    assert [p.name for p in tmp_path.iterdir()] == [nvrx_compat.ITERATION_FILE]


def test_the_layers_import_without_the_compiled_module():
    """0.6's one compiled module (CUPTI, for GPU straggler detection) cannot load without CUDA; the layers
    we use must not need it."""
    code = ("import sys; sys.modules['nvrx_cupti_module'] = None\n"
            "from nvidia_resiliency_ext import inprocess\n"
            "from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient, launcher\n"
            "from trainer import nvrx_compat\n"
            "assert nvrx_compat.has_inprocess() and nvrx_compat.has_fault_tolerance()\n")
    out = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]


def test_the_wrapper_takes_every_setting_we_need():
    kw = nvrx_compat.wrapper_kwargs(store_kwargs={}, initialize=None, abort=None, finalize=None, soft_timeout=1,
                                    hard_timeout=2, rank_filter=None, monitor_process_pidfile=None)
    assert {"store_kwargs", "initialize", "abort", "finalize", "soft_timeout", "hard_timeout"} <= set(kw)


def test_the_trainers_we_start_run_this_release():
    """The harness (and the local launcher) hand a trainer this tree first and then the parent's
    PYTHONPATH: dropping the latter ran the 0.6.0 pass's trainers with the venv's 0.4.1."""
    from tests.trainer.conftest import child_env

    code = "import importlib.metadata as m; print(m.version('nvidia-resiliency-ext'))"
    out = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == nvrx_compat.version_str(), out.stderr[-2000:]
