"""The HTTP reporter: batches, spools while the control plane is down, replays in order exactly once,
drops batches the server refuses for good, never blocks or raises into the caller."""

import json
import time

from tests.trainer.conftest import Receiver
from trainer.control import CommandInbox
from trainer.reporter import HttpReporter, NullReporter, make_reporter
from trainer.wire import EventKind, parse_batch


def wait_for(pred, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def make(tmp_path, url, **kw):
    return HttpReporter(url=url, job_id="42", token="tok", source="rank:0", rank=0,
                        spool_dir=str(tmp_path / "spool"), interval_s=kw.pop("interval_s", 0.1), **kw)


def test_it_batches_heartbeats_and_events(tmp_path, receiver):
    rep = make(tmp_path, receiver.url, interval_s=0.5)
    for i in range(200):
        rep.heartbeat(step=i, phase="train", loss=1.0 / (i + 1), step_time_s=0.01, tokens_per_s=100.0)
        rep.event(EventKind.CHECKPOINT, {"step": i, "state": "in_flight"})  # parse_batch checks data per kind
    rep.close()
    assert len(receiver.heartbeats()) == 200 and len(receiver.events()) == 200
    assert len(receiver.batches) <= 3
    b = receiver.batches[0]
    assert b["_path"] == "/api/v1/jobs/42/ingest" and b["_auth"] == "Bearer tok"
    parse_batch({k: v for k, v in b.items() if not k.startswith("_")}, now=time.time(), world_size=2)


def test_it_spools_while_down_and_replays_in_order_exactly_once(tmp_path):
    recv = Receiver()  # not started: the control plane is down
    rep = make(tmp_path, recv.url)
    for i in range(50):
        rep.event(EventKind.CHECKPOINT, {"n": i})
        time.sleep(0.01)
    assert wait_for(lambda: len(list((tmp_path / "spool" / "rank0").glob("*.json"))) >= 2)
    recv.start()
    try:
        for i in range(50, 60):
            rep.event(EventKind.CHECKPOINT, {"n": i})
        assert wait_for(lambda: len(recv.events()) >= 60)
        rep.close()
        ns = [e["data"]["n"] for e in recv.events()]
        assert ns == list(range(60))
        ids = [e["id"] for e in recv.events()]
        assert len(set(ids)) == 60
        assert not list((tmp_path / "spool" / "rank0").glob("*.json"))
    finally:
        recv.stop()


def test_it_retries_on_5xx_and_429(tmp_path, receiver):
    receiver.status = 503
    rep = make(tmp_path, receiver.url)
    rep.event(EventKind.LAUNCHER, {"message": "a"})
    time.sleep(0.5)
    receiver.status = 429
    rep.event(EventKind.LAUNCHER, {"message": "b"})
    time.sleep(0.5)
    receiver.status = 200
    assert wait_for(lambda: len(receiver.events()) == 2)
    rep.close()
    assert [e["data"]["message"] for e in receiver.events()] == ["a", "b"]


def test_it_drops_a_batch_the_server_refuses_and_logs_why(tmp_path, receiver, caplog):
    receiver.status = 400
    rep = make(tmp_path, receiver.url)
    rep.event(EventKind.LAUNCHER, {"message": "bad"})
    assert wait_for(lambda: "refused by test" in caplog.text)
    receiver.status = 200
    rep.event(EventKind.LAUNCHER, {"message": "good"})
    assert wait_for(lambda: len(receiver.events()) == 1)
    rep.close()
    assert receiver.events()[0]["data"]["message"] == "good"
    assert not list((tmp_path / "spool" / "rank0").glob("*.json"))


def test_it_never_blocks_the_caller(tmp_path, receiver):
    receiver.delay_s = 1.0  # a slow control plane
    rep = make(tmp_path, receiver.url)
    times = []
    for i in range(5000):
        t = time.perf_counter()
        rep.heartbeat(step=i, phase="train", loss=float("nan"), step_time_s=0.1, tokens_per_s=1.0)
        rep.event(EventKind.CYCLE, {"mark": "first_step_at", "step": i})
        times.append(time.perf_counter() - t)
    times.sort()
    assert times[int(len(times) * 0.99)] < 0.001
    rep.close(timeout_s=0.2)  # returns promptly even though a request is in flight


def test_it_hands_commands_to_the_inbox_once(tmp_path, receiver):
    inbox = CommandInbox(str(tmp_path / "done.json"))
    receiver.commands = [{"id": 7, "kind": "stop", "level": None, "rank": None, "fault": None}]
    rep = make(tmp_path, receiver.url, on_commands=inbox.offer)
    rep.heartbeat(step=1, phase="train")
    assert wait_for(lambda: receiver.batches)
    rep.heartbeat(step=2, phase="train")
    time.sleep(0.3)
    rep.close()
    assert inbox.take()["id"] == 7
    assert inbox.take() is None
    inbox.offer(receiver.commands)  # re-sent until acknowledged: deduped, also across restarts
    assert inbox.take() is None
    assert CommandInbox(str(tmp_path / "done.json")).take() is None


def test_it_uses_a_null_reporter_without_a_url(tmp_path):
    rep = make_reporter(url="", job_id="", token="", source="rank:0", rank=0, spool_dir=str(tmp_path),
                        interval_s=1.0)
    assert isinstance(rep, NullReporter)
    rep.heartbeat(step=1, phase="train")
    rep.event(EventKind.FAULT, {})
    rep.close()


def test_it_journals_every_event_it_sends_when_asked(tmp_path, receiver, monkeypatch):
    monkeypatch.setenv("UNBROKEN_REPORTER_JOURNAL_DIR", str(tmp_path))
    rep = make(tmp_path, receiver.url)
    for i in range(5):
        rep.event(EventKind.FAULT, {"fault": "exception", "step": i})
    rep.close()
    lines = [json.loads(x) for f in tmp_path.glob("*.jsonl") for x in f.read_text().splitlines()]
    assert [e["id"] for e in lines] == [e["id"] for e in receiver.events()]
    assert [e["data"]["step"] for e in lines] == [0, 1, 2, 3, 4]


def test_an_acknowledgement_goes_upstream_at_once_through_the_node_agent(tmp_path, receiver):
    """Beats wait for the next interval; a command_ack does not (reporter and agent both send it now)."""
    from trainer.agent import NodeAgent

    agent = NodeAgent(upstream=receiver.url, job_id="42", token="tok", spool_dir=str(tmp_path / "agent"),
                      interval_s=30.0).start()
    rep = make_reporter(url=receiver.url, agent_url=agent.url, job_id="42", token="tok", source="rank:0", rank=0,
                        spool_dir=str(tmp_path / "spool"), interval_s=30.0)
    try:
        time.sleep(0.2)  # both are now inside their first 30 s wait
        rep.heartbeat(step=7, phase="train")
        time.sleep(0.5)
        assert receiver.batches == []  # a beat waits for the interval
        rep.event(EventKind.COMMAND_ACK, {"command_id": 3, "ok": True, "detail": "accepted"})
        assert wait_for(lambda: any(e["kind"] == "command_ack" for e in receiver.events()), 5)
        assert [h["step"] for h in receiver.heartbeats()] == [7]  # what was queued before it went with it
        assert rep.sent_direct == 0
    finally:
        rep.close(timeout_s=1)
        agent.stop(timeout_s=1)


def test_a_rank_behind_a_node_agent_gets_a_command_between_its_posts(tmp_path, receiver):
    """The agent learns a command from its upstream answer; the rank, which has nothing to post, asks the
    agent half-way through its interval (loopback GET) and gets it without a post of its own."""
    from trainer.agent import NodeAgent

    agent = NodeAgent(upstream=receiver.url, job_id="42", token="tok", spool_dir=str(tmp_path / "agent"),
                      interval_s=0.3).start()
    inbox: list = []
    rep = make_reporter(url=receiver.url, agent_url=agent.url, job_id="42", token="tok", source="rank:0", rank=0,
                        spool_dir=str(tmp_path / "spool"), interval_s=4.0, on_commands=inbox.extend)
    try:
        rep.heartbeat(step=1, phase="train")
        rep.flush()  # the rank's one post: the agent now has something to send upstream
        assert wait_for(lambda: receiver.heartbeats(), 5)
        receiver.commands.append({"id": 9, "kind": "restart", "rank": 0})
        # Another rank of the node posts (the same call the agent's HTTP handler makes); the agent's next
        # upstream send brings the command back.
        beat = {"rank": 1, "step": 1, "phase": "train", "at": time.time()}
        assert agent.take("42", b"Bearer tok", json.dumps({"heartbeats": [beat], "events": []}).encode())[0] == 200
        assert wait_for(lambda: agent.commands, 5)
        assert wait_for(lambda: inbox, 4.0 + 0.5), "the rank never asked its agent"  # one poll per interval
        assert [c["id"] for c in inbox] == [9] and rep.polls >= 1
        assert rep.sent_batches == 1  # no post of its own brought it
    finally:
        rep.close(timeout_s=1)
        agent.stop(timeout_s=1)
    assert agent.poll("42", b"Bearer wrong")[0] == 401 and agent.poll("7", b"Bearer tok")[0] == 404
