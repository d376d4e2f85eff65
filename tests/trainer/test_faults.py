"""Each fault class is recovered by the expected layer, training resumes from the newest durable
checkpoint, and the final loss matches an uninterrupted run (2 ranks, gloo on CPU, real processes)."""

import pytest

from tests.trainer.conftest import launch

STEPS = ["--steps", "24", "--ckpt-interval", "5", "--soft-timeout", "3", "--hard-timeout", "8"]
pytestmark = [pytest.mark.slow, pytest.mark.nvrx]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    run = launch(tmp_path_factory.mktemp("baseline"), trainer_flags=STEPS)
    assert run.rc == 0, run.log[-3000:]
    return run.final_loss()


def cycle_marks(events, cycle):
    return {e["data"]["mark"]: e for e in events if e["kind"] == "cycle" and e["data"]["cycle"] == cycle}


@pytest.mark.parametrize("fault, fault_class, layer, cycle, in_job_flag", [
    ("exception", "exception", "in_process", "a0-ij0-ip1", True),
    ("nan_loss", "nan_loss", "in_process", "a0-ij0-ip1", True),
    ("hang", "hang", "in_process", "a0-ij0-ip1", True),
    ("hang_collective", "hang", "in_process", "a0-ij0-ip1", True),
    ("sigkill", "process_killed", "launcher", "a0-ij1", True),
    ("exception", "exception", "launcher", "a0-ij1", False),  # --no-in-process: the in-job layer restarts
])
def test_it_recovers_and_matches_the_uninterrupted_loss(tmp_path, receiver, baseline, fault, fault_class, layer,
                                                        cycle, in_job_flag):
    flags = [*STEPS, "--drill", f"12:{fault}:1"]
    if not in_job_flag:
        flags.append("--no-in-process")
    run = launch(tmp_path, trainer_flags=flags, report_url=receiver.url)
    assert run.rc == 0, run.log[-4000:]
    assert run.final_loss() == pytest.approx(baseline, rel=1e-5)
    faults = receiver.events("fault")
    assert len(faults) == 1, faults
    f = faults[0]["data"]
    assert (f["fault"], f["detected_by"], f["cycle"], f["rank"]) == (fault_class, layer, cycle, 1)
    # Evidence from the rank itself: an exception's traceback; for a hang, the stack of the hung main thread
    # that the in-process layer's monitor thread logs at abort.
    if fault == "exception":
        assert "Traceback (most recent call last)" in f["message"] and "DrillError" in f["message"], f["message"]
    if fault == "hang":
        mine = "r1 INFO trainer.resilience: abort at step 12: Stack of the main thread"
        assert mine in run.log, run.log[-4000:]
        # Rank 1's own stack (rank 0 logs its stack too, waiting in a collective, in either order).
        assert "in fire" in run.log.split(mine)[1][:3000]
    marks = cycle_marks(receiver.events(), cycle)
    for m in ("fault_at", "detected_at", "aborted_at", "restarted_at", "checkpoint_loaded_at", "first_step_at"):
        assert m in marks, (m, sorted(marks))
    loaded = marks["checkpoint_loaded_at"]["data"]
    assert loaded["step"] == 10  # the newest save before step 12
    # In process: the save's staged copy in memory; new processes: the durable checkpoint.
    assert loaded["restored_from"] == ("memory" if layer == "in_process" else "disk")
    # The step at the fault is the trainer's last completed step (12 steps done when the drill fires).
    assert f["step"] == 12 and marks["fault_at"]["data"]["step"] == 12
    assert marks["fault_at"]["at"] <= marks["detected_at"]["at"] <= marks["first_step_at"]["at"]
    finished = receiver.events("rank_finished")
    assert sorted(e["rank"] for e in finished) == [0, 1]
    if in_job_flag:  # the in-process monitor's log of each in-job round is kept, not overwritten by the next
        rounds = (0, 1) if cycle == "a0-ij1" else (0,)
        assert sorted(p.name for p in (tmp_path / "logs").glob("inprocess_monitor_1_*.log")) == [
            f"inprocess_monitor_1_a0_ij{r}.log" for r in rounds]
    started = [e["data"]["message"] for e in receiver.events("launcher") if e["data"]["message"].startswith("starting")]
    # By default ft_launcher starts fresh processes (its stock path): forked ranks step slower.
    assert started and not any("fork server" in m for m in started), started


def test_warm_ranks_are_forked_from_the_fork_server_and_recover_the_same(tmp_path, receiver, baseline):
    """UNBROKEN_FORK_RANKS=1 (the spec's ``fork_ranks``): each rank, the restarted ones too, is forked
    from a fork server that imported what ranks import."""
    run = launch(tmp_path, trainer_flags=[*STEPS, "--drill", "12:sigkill:1"], report_url=receiver.url,
                 env={"UNBROKEN_FORK_RANKS": "1"})
    assert run.rc == 0, run.log[-4000:]
    assert run.final_loss() == pytest.approx(baseline, rel=1e-5)
    f = receiver.events("fault")[0]["data"]
    assert (f["fault"], f["detected_by"], f["cycle"]) == ("process_killed", "launcher", "a0-ij1")
    started = [e["data"]["message"] for e in receiver.events("launcher") if e["data"]["message"].startswith("starting")]
    assert started and all("ranks forked from a warm fork server" in m for m in started), started


def test_an_in_job_restart_restores_from_the_node_local_copy(tmp_path, receiver, baseline):
    """--local-ckpt-dir: each rank keeps a copy of its newest async save on the node; the new processes
    of an in-job restart load it instead of the durable checkpoint. The launcher removes it at exit."""
    local = tmp_path / "shm"
    run = launch(tmp_path, trainer_flags=[*STEPS, "--drill", "12:sigkill:1", "--local-ckpt-dir", str(local)],
                 report_url=receiver.url)
    assert run.rc == 0, run.log[-4000:]
    assert run.final_loss() == pytest.approx(baseline, rel=1e-5)
    loaded = cycle_marks(receiver.events(), "a0-ij1")["checkpoint_loaded_at"]["data"]
    assert (loaded["step"], loaded["restored_from"]) == (10, "local")
    assert local.is_dir() and not any(local.iterdir())  # this attempt's copies are gone with its launcher


def test_it_fails_the_job_when_no_layer_is_on(tmp_path, receiver):
    run = launch(tmp_path, trainer_flags=[*STEPS, "--no-in-process", "--drill", "6:exception:0"], in_job=False,
                 report_url=receiver.url, timeout_s=120)
    assert run.rc != 0
    launcher = [e["data"]["message"] for e in receiver.events("launcher")]
    assert any("rank 0: exit 1" in m for m in launcher), launcher


def test_it_reports_job_level_restart_marks_on_a_new_attempt(tmp_path, receiver, baseline):
    first = launch(tmp_path, trainer_flags=[*STEPS, "--no-in-process", "--drill", "12:exception:0"], in_job=False,
                   timeout_s=120)
    assert first.rc != 0
    run = launch(tmp_path, trainer_flags=[*STEPS, "--no-in-process"], in_job=False, attempt=1,
                 report_url=receiver.url)
    assert run.rc == 0, run.log[-3000:]
    assert run.final_loss() == pytest.approx(baseline, rel=1e-5)
    marks = cycle_marks(receiver.events(), "job1")
    assert {"restarted_at", "checkpoint_loaded_at", "first_step_at"} <= set(marks)
    assert marks["checkpoint_loaded_at"]["data"]["step"] == 10
