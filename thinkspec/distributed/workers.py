"""The processes of ranks 1..N-1 of a tensor-parallel engine, seen from rank 0 (the main process).

`TPWorkers.start` spawns one process per rank (torch.multiprocessing, spawn), then joins the
torch.distributed group as rank 0 (NCCL on CUDA, gloo on CPU). A worker that raises sends its
traceback over a queue and exits with code 1; rank 0 turns a failed collective or a dead worker into
a TensorParallelError carrying that message. Workers leave when rank 0 broadcasts EXIT
(`shutdown`, also run when the engine is garbage-collected and at interpreter exit), when a
collective fails, and when rank 0's process disappears (each worker watches its parent).
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import astuple
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from thinkspec.distributed.step_channel import EXIT, StepHeader, TensorParallelError
from thinkspec.utils import logger

RENDEZVOUS_TIMEOUT = timedelta(minutes=10)  # every rank reaches the store
# Collectives: workers wait for rank 0's next step inside a broadcast, for as long as an idle server
# stays idle, so no collective times out (NCCL's watchdog would end the process). A dead rank is
# caught otherwise: gloo fails on the closed connection, NCCL is aborted by TPWorkers' monitor, and
# workers watch their parent.
COLLECTIVE_TIMEOUT = timedelta(days=365)
JOIN_TIMEOUT_S = 10.0
LEAVE_TIMEOUT_S = 10.0  # for the EXIT broadcast and for leaving the group at shutdown

# rank, world size, init_method, engine args, error queue
WorkerEntry = Callable[[int, int, str, Any, Any], None]


_JOINED = "thinkspec/joined"  # store counter: workers that reached the rendezvous


def init_distributed(
    rank: int,
    size: int,
    init_method: str,
    device: torch.device,
    check_workers: Callable[[], None] | None = None,
) -> None:
    """Join the default group: NCCL on CUDA (rank r on cuda:r), gloo on CPU.

    Rank 0 hosts the rendezvous store and, while it waits for the workers to reach it, calls
    check_workers, which raises when a worker has already failed (no wait for the timeout)."""
    if dist.is_initialized():
        raise TensorParallelError(
            "a tensor-parallel engine is already running in this process; shut it down "
            "(LLM.shutdown()) before starting another"
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    address = urlparse(init_method)  # tcp://host:port
    assert address.hostname is not None and address.port is not None, init_method
    store = dist.TCPStore(
        address.hostname, address.port, size, is_master=rank == 0, timeout=RENDEZVOUS_TIMEOUT,
        wait_for_workers=False,
    )  # fmt: skip
    if rank > 0:
        store.add(_JOINED, 1)
    else:
        deadline = time.monotonic() + RENDEZVOUS_TIMEOUT.total_seconds()
        while store.add(_JOINED, 0) < size - 1:
            if check_workers is not None:
                check_workers()
            if time.monotonic() > deadline:
                raise TensorParallelError(
                    f"tensor-parallel workers did not start within {RENDEZVOUS_TIMEOUT}"
                )
            time.sleep(0.02)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT,
        **({"device_id": device} if device.type == "cuda" else {}),
    )  # fmt: skip


def exit_with_parent() -> None:
    """In a worker: leave at once when the process that spawned it is gone (killed rank 0)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="thinkspec-parent-watch", daemon=True).start()


def report_failure(errors: Any, rank: int) -> None:
    """In a worker, from an except block: send the traceback to rank 0."""
    with contextlib.suppress(Exception):  # the queue's reader may be gone already
        errors.put((rank, traceback.format_exc()))


def free_port() -> int:
    """A free TCP port on the loopback interface (for init_method)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPWorkers:
    """Ranks 1..size-1 of one engine, and rank 0's membership of their group."""

    def __init__(self, procs: list[Any], errors: Any, device: torch.device) -> None:
        self.procs = procs
        self.errors = errors
        self.device = device
        self._messages: dict[int, str] = {}
        # Workers must not outlive the engine, even when nobody calls shutdown() (a finalizer also
        # runs at interpreter exit).
        self._finalizer = weakref.finalize(self, _close, procs, device)
        if device.type == "cuda":  # NCCL waits forever on a dead peer: abort the group instead
            threading.Thread(target=_abort_on_death, args=(procs, self._finalizer), daemon=True).start()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    @classmethod
    def start(cls, size: int, args: Any, device: torch.device, entry: WorkerEntry) -> TPWorkers:
        """Spawn ranks 1..size-1 running entry(rank, size, init_method, args, errors), then join the
        group as rank 0 on `device`."""
        ctx = mp.get_context("spawn")
        errors = ctx.Queue()
        init_method = f"tcp://127.0.0.1:{free_port()}"
        procs = [
            ctx.Process(
                target=entry,
                args=(rank, size, init_method, args, errors),
                name=f"thinkspec-tp{rank}",
                daemon=True,
            )
            for rank in range(1, size)
        ]
        for p in procs:
            p.start()
        workers = cls(procs, errors, device)
        try:
            init_distributed(0, size, init_method, device, workers.raise_if_failed)
        except BaseException:
            workers.shutdown()
            raise
        logger.info("tensor parallelism: %d ranks (%s)", size, dist.get_backend())
        return workers

    def raise_if_failed(self) -> None:
        """TensorParallelError with the failed worker's message when a worker has exited."""
        if any(not p.is_alive() for p in self.procs):
            raise self.failure(RuntimeError("a worker exited"))

    def failure(self, error: BaseException, wait_s: float = 5.0) -> TensorParallelError:
        """The error to raise after `error` broke a collective: the first failed worker's message
        when one exited (waiting up to wait_s for it), else `error` itself."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            self._drain()
            if self._messages:
                break
            if any(not p.is_alive() for p in self.procs):
                self._drain(timeout=0.5)
                break
            time.sleep(0.05)
        return TensorParallelError(self.describe() or f"tensor-parallel step failed: {error}")

    def describe(self) -> str:
        """What happened to the workers that failed or exited, '' when all are alive."""
        self._drain()
        lines = []
        for rank, p in enumerate(self.procs, start=1):
            if rank in self._messages:
                lines.append(f"tensor-parallel worker rank {rank} failed:\n{self._messages[rank]}")
            elif not p.is_alive():
                lines.append(f"tensor-parallel worker rank {rank} exited with code {p.exitcode}")
        return "\n".join(lines)

    def _drain(self, timeout: float = 0.0) -> None:
        while True:
            try:
                rank, message = self.errors.get(timeout=timeout) if timeout else self.errors.get_nowait()
            except (queue.Empty, OSError, ValueError):
                return
            self._messages.setdefault(rank, message)
            timeout = 0.0

    def shutdown(self) -> None:
        """Stop the workers (EXIT when all are alive, then join; terminate stragglers) and leave
        the group. Idempotent."""
        self._finalizer()


def _close(procs: list[Any], device: torch.device) -> None:
    if dist.is_initialized():
        if all(p.is_alive() for p in procs) and not _bounded(lambda: _send_exit(device), LEAVE_TIMEOUT_S):
            logger.warning("tensor-parallel shutdown: EXIT did not reach every worker; stopping them")
        # The workers leave the group first (on EXIT, or stopped below): rank 0 then has nothing in
        # flight with them when it leaves.
        _stop_processes(procs)
        _leave_group()
    else:
        _stop_processes(procs)


def _bounded(fn: Callable[[], None], timeout_s: float) -> bool:
    """Run fn in a daemon thread for at most timeout_s: True when it returned (an exception is logged
    and counts as returned), False when it is still blocked (a collective a dead peer never joins)."""

    def run() -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a worker died meanwhile: the caller stops the processes
            logger.warning("tensor-parallel shutdown: %s", e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return not thread.is_alive()


def _leave_group() -> None:
    """Destroy the default group; abort it when destroying does not return (NCCL can block there), so
    that shutdown never hangs and a later engine in this process can form a new group."""
    if _bounded(dist.destroy_process_group, LEAVE_TIMEOUT_S) and not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None or not _bounded(abort, LEAVE_TIMEOUT_S) or dist.is_initialized():
        logger.warning("tensor-parallel shutdown: the process group did not close")


def _abort_on_death(procs: list[Any], finalizer: weakref.finalize) -> None:
    """CUDA: when a worker dies while the engine runs, abort the NCCL group so that rank 0's pending
    collectives fail (and the step raises) instead of waiting for the timeout."""
    from multiprocessing.connection import wait

    wait([p.sentinel for p in procs])
    if finalizer.alive:
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None and dist.is_initialized():
            abort()


def _send_exit(device: torch.device) -> None:
    values = torch.tensor(astuple(StepHeader(EXIT, *([0] * 10))), dtype=torch.int64, device=device)
    dist.broadcast(values, src=0)  # what the workers' StepChannel.recv_header waits for
    if device.type == "cuda":  # NCCL only enqueues it: wait until every rank has it
        torch.cuda.synchronize(device)


def _stop_processes(procs: list[Any]) -> None:
    """Join each worker for a while, then terminate, then kill what is left."""
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)
