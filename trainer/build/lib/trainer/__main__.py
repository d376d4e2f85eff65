"""``python -m trainer``: one rank of an FSDP2 job (started by ``trainer.launch``, or alone as a 1-rank world)."""

from __future__ import annotations

import logging
import os
import sys
import warnings

import torch

from trainer import nvrx_compat
from trainer.config import TrainConfig, parse_config
from trainer.control import CommandInbox
from trainer.reporter import make_reporter
from trainer.resilience import make_ft, wrap_loop
from trainer.runtime import RankEnv, Session, connect_store
from trainer.train import run_iteration


def pick_device(cfg: TrainConfig, env: RankEnv) -> torch.device:
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is visible; use --device cpu")
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message=".*pynvml.*")
    warnings.filterwarnings("ignore", message=".*NumPy.*")
    env = RankEnv.from_env()
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format=f"%(asctime)s r{env.initial_rank} %(levelname)s %(name)s: %(message)s")
    try:
        cfg = parse_config(argv)
        cfg.check_layers(in_job=env.in_job, world_size=env.world_size)
        nvrx_compat.check_supported(in_process=cfg.in_process, in_job=env.in_job, ft_mode=cfg.ft_mode)
        device = pick_device(cfg, env)
    except ValueError as e:
        print(f"trainer: error: {e}", file=sys.stderr)
        return 2
    os.makedirs(cfg.run_dir, exist_ok=True)

    inbox = CommandInbox(os.path.join(cfg.run_dir, "commands_done.json")) if env.initial_rank == 0 else None
    reporter = make_reporter(url=cfg.report_url, job_id=cfg.job_id, token=cfg.token,
                             source=f"rank:{env.initial_rank}", rank=env.initial_rank, spool_dir=cfg.spool_dir,
                             interval_s=cfg.report_interval, on_commands=inbox.offer if inbox else None)
    session = Session(cfg=cfg, env=env, reporter=reporter, app_store=connect_store(env, env.app_store_port),
                      ft=make_ft(env, cfg.ft_mode), inbox=inbox, device=device)
    try:
        wrap_loop(session, lambda scope: run_iteration(session, scope))()
    except BaseException:
        logging.getLogger("trainer").exception("training failed")
        reporter.close(timeout_s=5.0)
        return 1
    reporter.close(timeout_s=10.0)
    if env.initial_rank == 0:
        print(f"FINAL_LOSS {session.last_loss!r}", flush=True)
    return 0


def entry(*argv: str) -> None:
    """One rank as a Python callable (``trainer.launch`` forks ranks from a warm fork server)."""
    rc = main(list(argv))
    if rc:
        sys.exit(rc)


if __name__ == "__main__":
    sys.exit(main())
