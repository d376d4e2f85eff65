"""Phase spans derived from facts: job-wide phases once, per-rank hung/dead from faults and health."""

from controlplane.dashboard.timeline import (
    CHECKPOINT_LOAD,
    CHECKPOINT_SAVE,
    DEAD,
    HUNG,
    RESTARTING,
    STARTING,
    TRAINING,
    job_spans,
    phase_for_fault,
    rank_spans,
)


def cycle(**marks):
    base = {
        "id": 1,
        "key": "a0-ij0-ip1",
        "fault_at": None,
        "detected_at": None,
        "aborted_at": None,
        "restarted_at": None,
        "checkpoint_loaded_at": None,
        "first_step_at": None,
    }
    return {**base, **marks}


def test_it_splits_a_cycle_into_restarting_load_and_first_step():
    c = cycle(
        fault_at=100.0,
        detected_at=100.2,
        aborted_at=100.3,
        restarted_at=100.5,
        checkpoint_loaded_at=101.0,
        first_step_at=101.5,
    )
    spans = job_spans(start=0.0, first_step=10.0, end=200.0, is_open=True, cycles=[c], checkpoints=[])
    got = [(s.phase, s.start, s.end) for s in spans]
    assert (STARTING, 0.0, 10.0) in got
    assert (TRAINING, 10.0, 200.0) in got
    assert (RESTARTING, 100.2, 100.5) in got
    assert (CHECKPOINT_LOAD, 100.5, 101.0) in got
    assert (RESTARTING, 101.0, 101.5) in got
    assert all(s.lane is None for s in spans)  # job-wide: drawn once across every lane


def test_it_keeps_an_open_cycle_open_until_now():
    spans = job_spans(
        start=0.0,
        first_step=1.0,
        end=50.0,
        is_open=True,
        cycles=[cycle(fault_at=40.0, detected_at=41.0)],
        checkpoints=[],
    )
    restarting = [s for s in spans if s.phase == RESTARTING]
    assert restarting[0].end == 50.0 and restarting[0].open


def test_it_shows_the_blocked_part_of_saves_and_whole_sync_saves():
    cks = [
        {
            "started_at": 20.0,
            "finished_at": 25.0,
            "blocking_s": 0.5,
            "mode": "async",
            "state": "durable",
            "step": 20,
        },
        {
            "started_at": 40.0,
            "finished_at": 43.0,
            "blocking_s": None,
            "mode": "sync",
            "state": "durable",
            "step": 40,
        },
        {
            "started_at": 60.0,
            "finished_at": None,
            "blocking_s": None,
            "mode": "async",
            "state": "in_flight",
            "step": 60,
        },
    ]
    spans = job_spans(start=0.0, first_step=1.0, end=100.0, is_open=False, cycles=[], checkpoints=cks)
    saves = [(s.start, s.end) for s in spans if s.phase == CHECKPOINT_SAVE]
    assert saves == [(20.0, 20.5), (40.0, 43.0)]


def test_it_marks_the_faulty_rank_hung_or_dead_until_the_abort():
    c = cycle(fault_at=100.0, detected_at=105.0, aborted_at=106.0, restarted_at=107.0)
    faults = [
        {"at": 100.0, "detected_at": 105.0, "rank": 3, "fault_class": "hang", "cycle_id": 1},
        {"at": 100.0, "detected_at": 101.0, "rank": 5, "fault_class": "process_killed", "cycle_id": 1},
        {
            "at": 150.0,
            "detected_at": 150.0,
            "rank": 1,
            "fault_class": "exception",
            "cycle_id": None,
        },  # instant
    ]
    spans = rank_spans(end=200.0, is_open=True, faults=faults, cycles_by_id={1: c}, ranks=[])
    assert [(s.lane, s.phase, s.start, s.end) for s in spans] == [
        (3, HUNG, 100.0, 106.0),
        (5, DEAD, 100.0, 106.0),
    ]


def test_it_marks_lost_and_stalled_ranks_from_their_health():
    ranks = [
        {"rank": 0, "health": "ok", "last_heartbeat_at": 199.0, "step_changed_at": 199.0},
        {"rank": 1, "health": "lost", "last_heartbeat_at": 150.0, "step_changed_at": 140.0},
        {"rank": 2, "health": "stalled", "last_heartbeat_at": 199.0, "step_changed_at": 120.0},
    ]
    spans = rank_spans(end=200.0, is_open=True, faults=[], cycles_by_id={}, ranks=ranks)
    assert [(s.lane, s.phase, s.start, s.open) for s in spans] == [
        (1, DEAD, 150.0, True),
        (2, HUNG, 120.0, True),
    ]


def test_it_maps_fault_classes_to_phases():
    assert phase_for_fault("hang") == HUNG
    assert phase_for_fault("stalled") == HUNG
    assert phase_for_fault("process_killed") == DEAD
    assert phase_for_fault("node_lost") == DEAD
    assert phase_for_fault("exception") == RESTARTING
    assert phase_for_fault("nan_loss") == RESTARTING
