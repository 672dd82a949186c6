"""Step-fault isolation: an exception while building or running a step fails the requests that
caused it, frees their KV blocks, and leaves the engine serving everyone else.

How a fault is attributed (recover_from_step_fault):

1. An error of the device itself (a CUDA error: the context is unusable afterwards), or of a
   tensor-parallel rank (TensorParallelError), is re-raised,
   so the engine is reported dead (the server's /health answers 503) with the cause logged.
2. Requests that finished during the failed step (before it raised) get their final output.
3. Async scheduling: a step still in flight is committed first, and each probe commits its own
   step, so probes start from committed state. A request left holding a pending token that no
   step will deliver (the failure came while committing) drops it, and its last input position
   is scheduled again (recomputing K/V writes the same values; the token is sampled again).
4. Every suspect (the running requests and the head of the waiting queue: those the failed step
   scheduled) is probed alone: one step with only that request scheduled. A probe that raises
   fails its request; the others simply made one step of progress. A request that is not the
   cause thus finishes with the same tokens as without the fault (greedy or seeded sampling
   depends only on the request itself).
5. A failed request finishes with finish_reason "error", `error` the message and
   `error_status` 400 when its own input caused it (token ids outside the vocabulary, or a
   ValueError / OverflowError: a value the engine could not hold), else 500.
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Any, Protocol

from thinkspec.distributed.step_channel import TensorParallelError
from thinkspec.engine.request_checks import input_problem, token_vocab_size
from thinkspec.engine.scheduler import Scheduler
from thinkspec.engine.sequence import Sequence, SequenceStatus
from thinkspec.models.loader import ModelInfo
from thinkspec.outputs import RequestOutput
from thinkspec.utils import logger


class StepHost(Protocol):
    """What fault recovery needs of the engine (LLMEngine)."""

    scheduler: Scheduler
    tokenizer: Any
    model_info: ModelInfo

    def run_step(self, finished_only: bool) -> list[RequestOutput]: ...

    def settle_in_flight(self, finished_only: bool) -> list[RequestOutput]: ...

    def repair_pending(self) -> None: ...

    def make_output(self, seq: Sequence) -> RequestOutput: ...

_DEVICE_ERROR_MARKS = ("CUDA error", "CUBLAS_STATUS_", "CUDNN_STATUS_", "device-side assert", "NCCL error")


def is_device_failure(error: BaseException) -> bool:
    """Whether `error` means the device (not one request) failed: nothing can run on it any more."""
    if type(error).__name__ == "AcceleratorError":  # torch >= 2.8 raises this for CUDA errors
        return True
    if isinstance(error, TensorParallelError):  # a rank failed: the split model cannot run
        return True
    text = str(error)
    return any(mark in text for mark in _DEVICE_ERROR_MARKS)


def recover_from_step_fault(
    engine: StepHost,
    error: Exception,
    finished_only: bool,
    pending: list[RequestOutput],
    unfinished: list[Sequence],
) -> list[RequestOutput]:
    """The outputs of a step that raised `error` (see the module docstring).

    pending: the engine's queued outputs (aborts) when the step began; unfinished: the requests
    not finished when it began.
    """
    if is_device_failure(error):
        logger.error("device failure in an engine step: %s: %s", type(error).__name__, error)
        raise error
    logger.warning("an engine step failed (%s: %s); isolating the cause", type(error).__name__, error)
    outputs = list(pending)
    outputs += [engine.make_output(s) for s in unfinished if s.is_finished and s.finish_reason != "abort"]
    with contextlib.suppress(Exception):  # settle a step in flight first; its requests are probed below
        outputs += engine.settle_in_flight(finished_only)
    engine.repair_pending()
    sch = engine.scheduler
    suspects = [s for s in sch.running if not s.is_finished]
    if sch.waiting:
        suspects.append(sch.waiting[0])
    for seq in suspects:
        if seq.is_finished:
            continue
        probe_outputs, probe_error = _probe(engine, seq, finished_only)
        outputs += probe_outputs
        if probe_error is not None and not seq.is_finished:
            outputs.append(_fail(engine, seq, probe_error))
    return outputs


def _probe(
    engine: StepHost, seq: Sequence, finished_only: bool
) -> tuple[list[RequestOutput], Exception | None]:
    """One step with only `seq` scheduled; the other requests keep their places and blocks."""
    sch = engine.scheduler
    running, waiting = sch.running, sch.waiting
    was_running = seq.status == SequenceStatus.RUNNING
    sch.running = [seq] if was_running else []
    sch.waiting = deque() if was_running else deque([seq])
    try:
        outputs = engine.run_step(finished_only)
        outputs += engine.settle_in_flight(finished_only)  # async scheduling: commit within the probe
        return outputs, None
    except Exception as e:  # noqa: BLE001 - the verdict on this request
        engine.repair_pending()
        return [], e
    finally:
        probe_running, probe_waiting = sch.running, sch.waiting
        if was_running:
            sch.running = [s for s in running if s is not seq or s in probe_running]
        else:
            sch.running = running + [s for s in probe_running if s is seq]
        sch.waiting = waiting if was_running else deque(s for s in waiting if s is not seq)
        if seq in probe_waiting:  # preempted or not admitted: back to the front
            sch.running = [s for s in sch.running if s is not seq]
            sch.waiting.appendleft(seq)


def _fail(engine: StepHost, seq: Sequence, error: Exception) -> RequestOutput:
    """Finish `seq` with an error output and free its KV blocks."""
    vocab = token_vocab_size(engine.tokenizer, engine.model_info.vocab_size)
    problem = input_problem(seq.request_id, seq.prompt_token_ids, seq.sampling_params, vocab)
    if problem is not None:
        status, message = 400, problem
    elif isinstance(error, (ValueError, OverflowError)):
        status, message = 400, f"the request's input failed in the engine: {type(error).__name__}: {error}"
    else:
        status, message = 500, f"internal error while running the request: {type(error).__name__}: {error}"
    logger.error("request %s failed (%d): %s", seq.request_id, status, message)
    engine.scheduler.fail(seq, message)  # finishes it and frees its blocks
    out = engine.make_output(seq)
    out.error = message
    out.error_status = status
    return out
