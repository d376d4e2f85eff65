"""The one vocabulary both sides speak: the phases of a rank, the classes of fault, the restart layers and
their cycles' marks, the kinds of event, checkpoint and command, and the key of a restart cycle.

Standard library only, like ``trainer.wire`` (which re-exports all of it: importers say ``trainer.wire``).
"""

from __future__ import annotations

from enum import StrEnum


class Phase(StrEnum):
    INIT = "init"
    TRAIN = "train"
    CHECKPOINT_SAVE = "checkpoint_save"
    CHECKPOINT_LOAD = "checkpoint_load"
    EVAL = "eval"  # a slow phase: the checkpoint timeout applies
    DATA = "data"
    RESTARTING = "restarting"
    STOPPED = "stopped"


# Phases in which a rank may rightly go quiet for long: the job's checkpoint timeout applies, not the
# step timeout (the control plane's deadlines, the SDK's ft_launcher keep-alive).
SLOW_PHASES = frozenset({Phase.CHECKPOINT_SAVE, Phase.CHECKPOINT_LOAD, Phase.EVAL, Phase.INIT, Phase.RESTARTING})


class FaultClass(StrEnum):
    EXCEPTION = "exception"
    HANG = "hang"
    PROCESS_KILLED = "process_killed"
    NAN_LOSS = "nan_loss"
    HEARTBEAT_LOST = "heartbeat_lost"
    STALLED = "stalled"
    NODE_LOST = "node_lost"
    OOM_KILLED = "oom_killed"
    EVICTED = "evicted"
    UNSCHEDULABLE = "unschedulable"
    IMAGE_PULL = "image_pull"


class DrillFault(StrEnum):
    """Faults the trainer can inject (fault drills)."""

    EXCEPTION = "exception"
    HANG = "hang"  # Python-level hang: the loop spins without progress
    HANG_COLLECTIVE = "hang_collective"  # hang in a C call / collective (GIL released)
    SIGKILL = "sigkill"
    NAN_LOSS = "nan_loss"
    SLOW_RANK = "slow_rank"  # not a fault: the rank spends an extra fraction of each step busy (a straggler)


class Layer(StrEnum):
    IN_PROCESS = "in_process"
    IN_JOB = "in_job"
    JOB = "job"
    NONE = "none"


class CycleMark(StrEnum):
    """Timestamps of one restart cycle, in order."""

    FAULT = "fault_at"
    DETECTED = "detected_at"
    ABORTED = "aborted_at"
    RESTARTED = "restarted_at"
    CHECKPOINT_LOADED = "checkpoint_loaded_at"
    FIRST_STEP = "first_step_at"


class CheckpointState(StrEnum):
    IN_FLIGHT = "in_flight"
    DURABLE = "durable"
    FAILED = "failed"
    ABANDONED = "abandoned"


class CheckpointMode(StrEnum):
    SYNC = "sync"
    ASYNC = "async"


class CommandKind(StrEnum):
    STOP = "stop"
    RESTART = "restart"
    INJECT_FAULT = "inject_fault"


class RestoredFrom(StrEnum):
    """Where a restart's state came from (the ``checkpoint_loaded_at`` cycle mark's ``restored_from``)."""

    MEMORY = "memory"  # the newest staged snapshot in host memory (in-process restarts)
    LOCAL = "local"  # this node's copy of the newest durable async save (in-job restarts)
    DISK = "disk"  # the newest durable checkpoint


class EventKind(StrEnum):
    """What an event's ``data`` holds, by kind:

    - ``rank_started``: iteration (in-process), restart_count (in-job), world_size, node, pid
    - ``rank_finished``: step, loss (final)
    - ``fault``: fault (FaultClass), cycle, message, detected_by (a Layer or "trainer"/"launcher")
    - ``cycle``: cycle (key shared by every rank and the launcher), layer, mark (CycleMark),
      step (for restarted/checkpoint_loaded: the step resumed from), restored_from (checkpoint_loaded:
      RestoredFrom)
    - ``checkpoint``: step, mode, state, blocking_s, write_s, bytes, interference_s (durable async
      saves: the extra time of the steps that overlapped the background save, against the steps
      just before it, its blocked time not included)
    - ``command_ack``: command_id, ok (bool), detail
    - ``launcher``: message (free-form facts only the launcher sees: exit codes, signals)
    - ``integration``: level (0 unmodified script, 1 SDK calls, 2 SDK entrypoint), entrypoint, sdk,
      torch, nvrx (versions) - sent by each rank of a job that runs the user's own code
    """

    RANK_STARTED = "rank_started"
    RANK_FINISHED = "rank_finished"
    FAULT = "fault"
    CYCLE = "cycle"
    CHECKPOINT = "checkpoint"
    COMMAND_ACK = "command_ack"
    LAUNCHER = "launcher"
    INTEGRATION = "integration"


def cycle_key(*, attempt: int = 0, restart_count: int | None = None, iteration: int | None = None) -> str:
    """The key of a restart cycle, identical on every rank, the launcher and the control plane.

    ``attempt`` counts job-level restarts (new processes or pods, started by the control plane),
    ``restart_count`` is ft_launcher's in-job round (TORCHELASTIC_RESTART_COUNT) and ``iteration``
    the in-process Wrapper iteration. A cycle is named by what restarted:
    job-level ``job<A>``; in-job ``a<A>-ij<N>``; in-process ``a<A>-ij<N>-ip<I>``.
    """
    if restart_count is None:
        return f"job{attempt}"
    if iteration is None:
        return f"a{attempt}-ij{restart_count}"
    return f"a{attempt}-ij{restart_count}-ip{iteration}"
