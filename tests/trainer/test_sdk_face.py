"""The SDK's public face: one import name, one way to declare an entrypoint, what ``Context`` shows,
``should_stop`` with one meaning, and ``ctx.phase`` at Level 2."""

from __future__ import annotations

import importlib
import textwrap
import warnings

import pytest

import unbroken

from .conftest import launch

LEVEL2_PHASES = textwrap.dedent("""\
    import time

    import unbroken


    @unbroken.entrypoint
    def train(ctx: unbroken.Context):
        ctx.init_process_group()
        try:
            ctx.phase("lunch")
        except ValueError as e:
            print("REFUSED", e, flush=True)
        ctx.step(1, loss=0.5)
        with ctx.phase("eval"):
            time.sleep(0.6)  # a few report intervals: the beats of the phase reach the receiver
        ctx.step(2, loss=0.25)
        with ctx.phase("checkpoint"):
            pass
        ctx.step(3, loss=0.125)


    if __name__ == "__main__":
        train()
""")


def test_the_sdk_imports_under_one_name_only():
    assert unbroken.__name__ == "unbroken"
    with pytest.raises(ImportError, match="`import unbroken`, not `import trainer.unbroken`"):
        importlib.import_module("trainer.unbroken")


def test_an_entrypoint_is_declared_one_way():
    assert "run" not in unbroken.__all__ and not hasattr(unbroken, "run")
    assert "entrypoint" in unbroken.__all__


def test_outside_the_product_the_context_shows_its_api_only_and_phases_are_checked_no_ops():
    seen = {}

    @unbroken.entrypoint
    def train(ctx: unbroken.Context) -> str:
        seen["attributes"] = sorted(n for n in vars(ctx) if not n.startswith("_"))
        seen["public"] = sorted(n for n in dir(ctx) if not n.startswith("_"))
        with pytest.raises(ValueError, match=r"unbroken: ctx\.phase\('lunch'\): choose one of checkpoint_"):
            ctx.phase("lunch")
        for name in unbroken.PHASES:
            with ctx.phase(name):
                pass
        assert not ctx.should_stop() and ctx.iteration == 0
        ctx.step(1, loss=0.5)
        return "done"

    assert train() == "done"
    assert seen["attributes"] == ["checkpoint"]
    assert seen["public"] == ["checkpoint", "device", "init_process_group", "iteration", "phase", "rank",
                              "should_stop", "step", "world_size"]


def test_level1s_rank_local_stop_has_its_own_name_and_the_old_one_warns():
    run = unbroken.init()
    assert run.stop_requested() is False
    with pytest.raises(ValueError, match=r"unbroken: run\.phase\('lunch'\): choose one of"):
        run.phase("lunch")
    unbroken._should_stop_warned = False
    with pytest.warns(DeprecationWarning, match=r"run\.stop_requested\(\)"):
        assert run.should_stop() is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run.should_stop() is False  # once only


def test_a_level2_phase_is_in_the_ranks_heartbeats(tmp_path, receiver):
    """A real launch of a one-rank Level-2 function: the beats between its steps carry the phase it marked
    (``checkpoint`` as ``checkpoint_save``), then training again; a name outside PHASES is refused."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text(LEVEL2_PHASES)
    r = launch(tmp_path / "run", trainer_flags=["--no-in-process"], nproc=1, in_job=False,
               entrypoint=str(work / "train.py"), report_url=receiver.url, report_interval=0.1, timeout_s=180)
    assert r.rc == 0, r.log[-3000:]
    assert "REFUSED unbroken: ctx.phase('lunch'): choose one of" in r.log, r.log[-3000:]
    beats = [(h["step"], h["phase"]) for h in receiver.heartbeats() if h.get("rank") == 0]
    after_first = beats[beats.index((1, "train")):]
    phases = [p for _, p in after_first]
    assert (1, "eval") in after_first and (2, "checkpoint_save") in after_first, beats
    i_eval, i_two = after_first.index((1, "eval")), after_first.index((2, "train"))
    assert i_eval < i_two and "train" in phases[i_eval:i_two], beats  # the phase ends before step 2
    assert after_first.index((2, "checkpoint_save")) < after_first.index((3, "train")), beats


LEVEL2_LONG_EVAL = textwrap.dedent("""\
    import time

    import unbroken


    @unbroken.entrypoint
    def train(ctx: unbroken.Context):
        ctx.init_process_group()
        ctx.step(1, loss=0.5)
        # 7 s of batches: past the in-process layer's soft (3 s) and hard (6 s) timeouts. Short calls: one
        # 7 s C call would stall NVRx's own main-thread probe, which no phase can feed.
        with ctx.phase("eval"):
            for _ in range(70):
                time.sleep(0.1)
        ctx.step(2, loss=0.25)
        print("ITERATION", ctx.iteration, flush=True)


    if __name__ == "__main__":
        train()
""")


def test_a_slow_phase_longer_than_the_in_process_timeouts_is_not_taken_for_a_hang(tmp_path, receiver):
    """An evaluation of 7 s under in-process restart with a 3 s soft and 6 s hard timeout: the phase keeps the
    in-process layer hearing from the rank (up to the checkpoint timeout), so no fault and no restart."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text(LEVEL2_LONG_EVAL)
    r = launch(tmp_path / "run", trainer_flags=["--soft-timeout", "3", "--hard-timeout", "6",
                                                "--step-timeout", "20"],
               nproc=1, in_job=False, entrypoint=str(work / "train.py"), report_url=receiver.url,
               report_interval=0.2, timeout_s=180)
    assert r.rc == 0, r.log[-3000:]
    assert "ITERATION 0" in r.log, r.log[-3000:]  # never restarted in-process
    assert not [e for e in receiver.events() if e.get("kind") == "fault"], receiver.events()
