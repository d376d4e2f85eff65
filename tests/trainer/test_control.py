"""The SDK loop's command agreement: a round about every ``AGREE_EVERY_S`` of steps, not every step."""

from trainer.control import AGREE_EVERY_S, CommandInbox, Control


def test_it_agrees_about_every_agree_every_s_of_steps_and_acts_on_a_command_within_two(tmp_path):
    inbox = CommandInbox(str(tmp_path / "done.json"))
    acks = []
    ctl = Control(inbox=inbox, pg=None, rank=0, world_size=1, in_process=True, in_job=True,
                  ack=lambda cid, ok, detail: acks.append((cid, ok)))
    step_time = 0.01  # 20 steps per round
    stop_at = None
    for step in range(1, 401):
        if step == 200:
            inbox.offer([{"id": 7, "kind": "stop"}])
        if ctl.agree_overlapped(step, None if step == 1 else step_time).stop:
            stop_at = step
    per_round = AGREE_EVERY_S / step_time
    assert ctl._round <= 400 / per_round + 2, ctl._round  # not a round per step
    assert stop_at is not None and 200 <= stop_at <= 200 + 2 * per_round, stop_at
    assert acks == [(7, True)]



def _two_attempts(rank: int, port: int, done_path: str, results) -> None:
    """One rank of two attempts over the job's store (a TCPStore that outlives them, as the launcher's)."""
    import datetime
    import time

    import torch.distributed as dist

    from trainer.control import NOTHING

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    inbox = CommandInbox(done_path) if rank == 0 else None
    if inbox is not None:
        inbox.offer([{"id": 5, "kind": "inject_fault", "fault": "exception", "rank": 1}])
    acks: list[int] = []
    seen = []
    for attempt in (1, 2):
        dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{attempt}", store), rank=rank,
                                world_size=2)
        ctl = Control(inbox=inbox, pg=dist.group.WORLD, rank=rank, world_size=2, in_process=True, in_job=True,
                      ack=lambda cid, ok, detail: acks.append(cid), store=store)
        seen.append(ctl.agree_overlapped(1, None))
        if attempt == 2 or rank == 1:  # attempt 1: rank 1, ahead, collects the round; rank 0 is cut short
            seen.append(ctl.agree_overlapped(2, None))
        store.add(f"ended{attempt}", 1)
        while store.add(f"ended{attempt}", 0) < 2:  # both ranks are through this attempt
            time.sleep(0.01)
        dist.destroy_process_group()
    results.put((rank, [(d.command_id, str(d.kind), d.rank) if d is not NOTHING else None for d in seen],
                 acks, inbox.peek() if inbox is not None else None))
    if rank == 1:
        store.set("rank1_done", "1")
    else:  # rank 0 hosts the store: it stays until rank 1 is through with it
        store.wait(["rank1_done"])


def test_a_command_a_peer_acted_on_is_not_posted_again_when_a_restart_cut_rank_0_short(tmp_path):
    """Rank 0 posts a round with an injected fault for rank 1; rank 1 collects it and fails before rank 0
    collects it (rank 1 was ahead). Rank 0 never marked it done, so the next attempt posted it again and the
    fault fired twice. A rank that collects a round records it in the job's store, and rank 0 reads that."""
    import multiprocessing

    from trainer.ports import free_port

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_two_attempts, args=(rank, port, str(tmp_path / "done.json"), results))
             for rank in (0, 1)]
    [p.start() for p in procs]
    out = {rank: (seen, acks, pending) for rank, seen, acks, pending in (results.get(timeout=120) for _ in procs)}
    [p.join(30) for p in procs]
    # Rank 1: attempt 1 posts, then collects the injected fault; attempt 2 posts and collects nothing.
    assert out[1][0] == [None, (5, "inject_fault", 1), None, None]
    # Rank 0: the command was acknowledged once, and attempt 2 did not post it again: it is done.
    assert out[0][0] == [None, None, None]
    assert out[0][1] == [5] and out[0][2] is None
