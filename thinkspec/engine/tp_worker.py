"""The process of one tensor-parallel rank > 0: its shards, its runners, and the step loop.

Each worker builds what rank 0 builds up to the runners (factory.load_models and build_runners with
its own TPLayout: the same collectives in the same order), then runs every step rank 0 broadcasts
(ModelRunner.run_step) until the EXIT header. It holds no scheduler, tokenizer or sampler.
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import Any

import torch

from thinkspec.distributed.parallel_state import TPLayout
from thinkspec.distributed.step_channel import EXIT
from thinkspec.distributed.workers import exit_with_parent, init_distributed, report_failure
from thinkspec.engine.factory import build_runners, load_models
from thinkspec.engine_args import EngineArgs
from thinkspec.utils import logger, resolve_device


def run_worker(rank: int, size: int, init_method: str, args: EngineArgs, errors: Any) -> None:
    """Process entry of rank `rank` (spawned by distributed.workers.TPWorkers.start)."""
    exit_with_parent()
    # Ctrl-C reaches the whole process group: rank 0 decides (a server drains first, then stops us).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logger.setLevel(logging.WARNING)  # rank 0 logs for the engine
    try:
        device = resolve_device(args.device)
        if device.type == "cuda":
            device = torch.device("cuda", rank)
        init_distributed(rank, size, init_method, device)
        models = load_models(args, TPLayout(rank, size))
        runners = build_runners(args, models)
        serve(runners.target, runners.draft if models.draft_split else None)
    except BaseException:  # noqa: BLE001 - every failure goes to rank 0, then the process ends
        report_failure(errors, rank)
        sys.exit(1)
    torch.distributed.destroy_process_group()


@torch.inference_mode()
def serve(target: Any, draft: Any | None) -> None:
    """Run rank 0's steps on this rank's runners (target: runner 0, draft: runner 1) until EXIT."""
    runners = [target, draft]
    channel = target.channel
    while True:
        header = channel.recv_header()
        if header.runner == EXIT:
            return
        runner = runners[header.runner]
        if runner is None:
            raise RuntimeError(f"step for runner {header.runner}, which this rank does not hold")
        runner.run_step(header, None)
