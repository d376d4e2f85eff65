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
