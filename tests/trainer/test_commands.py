"""Commands from the control plane: every rank acts at the same step, rank 0 acknowledges each once."""

import pytest

from tests.trainer.conftest import launch

pytestmark = [pytest.mark.slow, pytest.mark.nvrx]


def cmd(id, kind, level=None, rank=None, fault=None):
    return {"id": id, "kind": kind, "level": level, "rank": rank, "fault": fault, "issued_at": 0.0}


def test_it_injects_restarts_and_stops_on_command(tmp_path, receiver):
    receiver.commands = [
        cmd(1, "inject_fault", rank=1, fault="exception"),
        cmd(2, "restart", level="in_job"),
        cmd(3, "restart", level="bogus"),
        cmd(4, "stop"),
    ]
    run = launch(tmp_path, trainer_flags=["--steps", "400", "--ckpt-interval", "5"], report_url=receiver.url)
    assert run.rc == 0, run.log[-4000:]
    acks = {e["data"]["command_id"]: e["data"] for e in receiver.events("command_ack")}
    assert sorted(acks) == [1, 2, 3, 4]
    assert [acks[i]["ok"] for i in (1, 2, 3, 4)] == [True, True, False, True]
    assert "bogus" in acks[3]["detail"]
    assert len(receiver.events("command_ack")) == 4  # acted on once each, though re-sent until acked
    faults = receiver.events("fault")
    assert [(f["data"]["fault"], f["data"]["detected_by"], f["data"]["rank"]) for f in faults] == [
        ("exception", "in_process", 1)]
    launcher = " ".join(e["data"]["message"] for e in receiver.events("launcher"))
    assert "exit 75" in launcher and "restarted (round 1)" in launcher
    finished = receiver.events("rank_finished")
    assert len(finished) == 2
    stop_step = finished[0]["data"]["step"]
    assert stop_step < 400
    durable = [e["data"]["step"] for e in receiver.events("checkpoint") if e["data"]["state"] == "durable"]
    assert durable[-1] == stop_step  # the final checkpoint of a graceful stop
