"""The node agent (trainer/agent.py) against the real control plane: the node's ranks' reports become one
request per interval, commands come back through it, and nothing is lost or stored twice when the agent
is killed or the control plane stops.

Real sockets throughout: a uvicorn server (the production app) on the shared PostgreSQL test database,
the agent (in this process, or as the launcher runs it: its own process, kept running), real reporters.
"""

import time

import pytest

from controlplane.jobs.models import Command, Event, Rank
from tests.controlplane.conftest import make_job, needs_postgres
from tests.controlplane.ingest.test_resilience import Server, wait_for
from trainer.agent import AgentProcess, NodeAgent
from trainer.ports import free_port
from trainer.reporter import HttpReporter, make_reporter
from trainer.wire import EventKind

pytestmark = [needs_postgres(), pytest.mark.django_db(transaction=True), pytest.mark.postgres]
RANKS = 4


@pytest.fixture
def server():
    srv = Server(free_port())
    srv.start()
    yield srv
    srv.kill()


def _reporters(agent_url: str, direct_url: str, job, token, tmp_path, inbox=None) -> list[HttpReporter]:
    return [make_reporter(url=direct_url, agent_url=agent_url, job_id=str(job.pk), token=token, source=f"rank:{r}",
                          rank=r, spool_dir=str(tmp_path / "ranks"), interval_s=0.05,
                          on_commands=(lambda cmds, r=r: inbox.setdefault(r, []).extend(cmds)) if inbox is not None
                          else None)
            for r in range(RANKS)]


def _report(reps, steps) -> None:
    for step in steps:
        for r, rep in enumerate(reps):
            rep.heartbeat(step=step, phase="train")
            rep.event(EventKind.CHECKPOINT, {"step": step * 10 + r, "mode": "sync", "state": "durable"})
        time.sleep(0.05)


def _saves(job) -> list[int]:
    return sorted(job.checkpoints.values_list("step", flat=True))


def _expected(steps) -> list[int]:
    return sorted(s * 10 + r for s in steps for r in range(RANKS))


def test_the_node_sends_one_request_per_interval_and_gets_its_commands(server, tmp_path):
    job, token = make_job(spec={"procs_per_node": RANKS})
    direct = f"http://127.0.0.1:{server.port}"
    agent = NodeAgent(upstream=direct, job_id=str(job.pk), token=token, spool_dir=str(tmp_path),
                      interval_s=0.5).start()
    inbox: dict = {}
    reps = _reporters(agent.url, direct, job, token, tmp_path, inbox)
    try:
        _report(reps, range(1, 21))
        cmd = Command.objects.create(job=job, kind="inject_fault", fault="exception", rank=1)
        _report(reps, range(21, 31))
        assert wait_for(lambda: _saves(job) == _expected(range(1, 31)), 30), len(_saves(job))
        # Ranks get commands in the answers to their posts: they keep beating, as training ranks do.
        step = 31
        deadline = time.time() + 15
        while not all(any(c["id"] == cmd.pk for c in inbox.get(r, [])) for r in range(RANKS)):
            assert time.time() < deadline, {r: [c["id"] for c in inbox.get(r, [])] for r in range(RANKS)}
            for rep in reps:
                rep.heartbeat(step=step, phase="train")
            step += 1
            time.sleep(0.1)
    finally:
        for rep in reps:
            rep.close()
        agent.stop()
    sent_by_ranks = sum(rep.sent_batches for rep in reps)
    assert sent_by_ranks >= 4 * agent.upstream_requests, (sent_by_ranks, agent.upstream_requests)
    assert sum(rep.sent_direct for rep in reps) == 0
    assert Rank.objects.filter(job=job, last_step__gte=30).count() == RANKS
    assert set(Event.objects.filter(job=job).values_list("source", flat=True)) == {agent.source}


def test_a_killed_agent_loses_nothing_and_counts_nothing_twice(server, tmp_path):
    job, token = make_job(spec={"procs_per_node": RANKS})
    direct = f"http://127.0.0.1:{server.port}"
    agent = AgentProcess(upstream=direct, job_id=str(job.pk), token=token, spool_dir=str(tmp_path / "agent"),
                         interval_s=0.3).start()
    reps = _reporters(agent.url, direct, job, token, tmp_path)
    try:
        assert wait_for(lambda: _reachable(agent.port), 20), "the agent did not start"
        _report(reps, range(1, 11))
        agent.kill()  # mid-run: what it took is on its disk; the ranks post directly until it is back
        _report(reps, range(11, 21))
        assert wait_for(lambda: agent.restarts >= 1 and _reachable(agent.port), 20)
        _report(reps, range(21, 31))
        assert wait_for(lambda: _saves(job) == _expected(range(1, 31)), 60), len(_saves(job))
    finally:
        for rep in reps:
            rep.close()
        agent.stop()
    assert _saves(job) == _expected(range(1, 31))  # every save once
    assert sum(rep.sent_direct for rep in reps) > 0  # the ranks really went around it


def test_the_agent_spools_while_the_control_plane_is_down(server, tmp_path):
    job, token = make_job(spec={"procs_per_node": RANKS})
    direct = f"http://127.0.0.1:{server.port}"
    agent = NodeAgent(upstream=direct, job_id=str(job.pk), token=token, spool_dir=str(tmp_path), interval_s=0.2).start()
    reps = _reporters(agent.url, direct, job, token, tmp_path)
    try:
        _report(reps, range(1, 6))
        assert wait_for(lambda: len(_saves(job)) == 5 * RANKS, 20)
        server.kill()
        _report(reps, range(6, 16))  # the agent takes them and keeps them on disk
        time.sleep(0.5)
        assert agent.spool.pending() and len(_saves(job)) == 5 * RANKS
        server.start()
        assert wait_for(lambda: _saves(job) == _expected(range(1, 16)), 60), len(_saves(job))
    finally:
        for rep in reps:
            rep.close()
        agent.stop()
    assert sum(rep.sent_direct for rep in reps) == 0  # the agent took everything; the ranks never waited


def test_the_agent_refuses_a_wrong_token_and_names_its_job(tmp_path):
    agent = NodeAgent(upstream="http://127.0.0.1:1", job_id="7", token="right-token", spool_dir=str(tmp_path))
    assert agent.take("7", b"Bearer wrong", b"{}")[0] == 401
    assert agent.take("8", b"Bearer right-token", b"{}")[0] == 404
    assert agent.take("7", b"Bearer right-token", b"not json")[0] == 400
    assert agent.take("7", b"Bearer right-token", b'{"heartbeats": 3}')[0] == 422
    assert not agent.spool.pending()
    agent.server.server_close()


def _reachable(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0
