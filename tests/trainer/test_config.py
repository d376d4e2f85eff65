"""Config validation: every error names the flag that fixes it."""

import pytest

from trainer import nvrx_compat
from trainer.config import ALL_RANKS, Drill, parse_config
from trainer.launch import launcher_args, parse
from trainer.wire import DrillFault


def cfg(*flags, env=None):
    return parse_config(["--run-dir", "/tmp/x", *flags], env=env or {})


@pytest.mark.parametrize("flags, flag", [
    (["--preset", "huge"], "--preset"),
    (["--steps", "0"], "--steps"),
    (["--keep-ckpts", "0"], "--keep-ckpts"),
    (["--ckpt-interval", "-1"], "--ckpt-interval"),
    (["--soft-timeout", "10", "--hard-timeout", "5"], "--hard-timeout"),
    (["--soft-timeout", "1"], "--soft-timeout"),
    (["--report-interval", "0"], "--report-interval"),
    (["--report-url", "ftp://x", "--job-id", "j"], "--report-url"),
    (["--report-url", "http://x"], "--job-id"),
    (["--drill", "12:boom:1"], "--drill"),
    (["--drill", "12:exception"], "--drill"),
    (["--steps", "10", "--drill", "12:exception:1"], "--drill"),
])
def test_it_names_the_flag_to_fix(flags, flag):
    with pytest.raises(ValueError, match=flag):
        cfg(*flags)


def test_it_requires_a_run_dir():
    with pytest.raises(ValueError, match="--run-dir"):
        parse_config([], env={})


def test_it_reads_identity_and_secrets_from_env(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    c = parse_config(["--report-url", "http://cp:8000/"], env={
        "UNBROKEN_RUN_DIR": "/runs/1", "UNBROKEN_JOB_ID": "17", "UNBROKEN_ATTEMPT": "2",
        "UNBROKEN_TOKEN_FILE": str(token_file)})
    assert (c.run_dir, c.job_id, c.attempt, c.token, c.report_url) == ("/runs/1", "17", 2, "s3cret", "http://cp:8000")
    assert "s3cret" not in repr(c)
    assert c.ckpt_dir == "/runs/1/checkpoints" and c.spool_dir == "/runs/1/spool"


def test_it_parses_drills():
    assert Drill.parse("12:hang_collective:*") == Drill(step=12, fault=DrillFault.HANG_COLLECTIVE, rank=ALL_RANKS)
    assert Drill.parse("3:sigkill:1").key == "3:sigkill:1"


def test_it_parses_a_slow_rank_drill_with_its_fraction():
    assert Drill.parse("50:slow_rank:1:0.5") == Drill(step=50, fault=DrillFault.SLOW_RANK, rank=1, fraction=0.5)
    assert Drill.parse("50:slow_rank:1").fraction == 0.3
    with pytest.raises(ValueError, match="FRACTION"):
        Drill.parse("50:slow_rank:1:fast")
    with pytest.raises(ValueError, match="STEP:FAULT:RANK"):
        Drill.parse("50:sigkill:1:0.5")  # only slow_rank takes a fraction
    with pytest.raises(ValueError, match="--straggler-window"):
        cfg("--straggler-window", "0.5")


def test_it_orders_the_layer_timeouts():
    c = cfg("--hard-timeout", "40", "--step-timeout", "30")
    c.check_layers(in_job=False)
    with pytest.raises(ValueError, match="--step-timeout"):
        c.check_layers(in_job=True)
    with pytest.raises(ValueError, match="rank 3"):
        cfg("--drill", "1:exception:3").check_layers(in_job=False, world_size=2)


def test_it_validates_the_launch_command():
    with pytest.raises(ValueError, match="--node-rank"):
        parse(["--nnodes", "1", "--node-rank", "1", "--run-dir", "/tmp/x"])
    with pytest.raises(ValueError, match="--rdzv-endpoint"):
        parse(["--rdzv-endpoint", "nohost", "--run-dir", "/tmp/x"])
    with pytest.raises(ValueError, match="--drill"):
        parse(["--nproc-per-node", "2", "--run-dir", "/tmp/x", "--", "--drill", "1:exception:2"])


def test_it_builds_ft_launcher_flags_from_trainer_timeouts():
    ns, targs, c = parse(["--nproc-per-node", "2", "--rdzv-endpoint", "h:29400", "--max-restarts", "4",
                          "--run-dir", "/tmp/x", "--job-id", "9", "--",
                          "--step-timeout", "20", "--ckpt-timeout", "50"])
    args = launcher_args(ns, c, targs)
    assert "--max-restarts=4" in args and "-m" in args and args[args.index("-m") + 1] == "trainer.standby"
    assert "--ft-rank-heartbeat-timeout=20.0" in args
    assert "--ft-enable-nic-monitor=false" in args
    ns, targs, c = parse(["--no-in-job", "--run-dir", "/tmp/x"])
    args = launcher_args(ns, c, targs)
    assert "--max-restarts=0" in args and args[args.index("-m") + 1] == "trainer.shim"  # no restarts: no standbys
    for off in (["--no-standby-ranks"], ["--fork-ranks"]):
        ns, targs, c = parse(["--run-dir", "/tmp/x", *off])
        args = launcher_args(ns, c, targs)
        assert args[args.index("-m") + 1] == "trainer.shim"


def test_it_refuses_what_the_installed_nvrx_cannot_run(monkeypatch):
    nvrx_compat.check_supported(in_process=True, in_job=True)
    monkeypatch.setattr(nvrx_compat, "has_inprocess", lambda: False)
    with pytest.raises(ValueError, match="--no-in-process"):
        nvrx_compat.check_supported(in_process=True, in_job=False)
    monkeypatch.setattr(nvrx_compat, "version", lambda: (0, 3, 0))
    with pytest.raises(ValueError, match="older than"):
        nvrx_compat.check_supported(in_process=False, in_job=True)


def test_it_filters_wrapper_kwargs_to_the_installed_release():
    kw = nvrx_compat.wrapper_kwargs(soft_timeout=1, hard_timeout=2, not_a_real_argument=3)
    assert kw == {"soft_timeout": 1, "hard_timeout": 2}


def test_it_picks_a_master_port_whose_store_ports_are_free_too():
    import socket

    from trainer.ports import free_port_block

    base = free_port_block(3)
    for port in range(base, base + 3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # raises if the block was not free
