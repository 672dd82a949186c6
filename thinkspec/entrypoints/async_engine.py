"""AsyncLLMEngine: one background thread owns an LLMEngine; asyncio code adds, streams and aborts.

Every engine call happens on that thread, so the engine needs no locks. Requests and aborts
reach it through a thread-safe queue; each request's outputs come back on its own asyncio queue.
The thread steps while work exists and sleeps on an event otherwise, so concurrent requests are
batched by the engine's scheduler like any others.

Failure rules: an exception while adding one request fails that request only. LLMEngine.step()
isolates faults itself (engine/faults.py: the requests that caused one finish with an error and
the rest go on); what it still raises (a device failure) marks the engine dead: every in-flight
and later request fails with EngineDeadError and `dead_error` says why (the server's /health
reports it).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from thinkspec.outputs import RequestOutput
from thinkspec.sampling_params import SamplingParams
from thinkspec.spec_decode.metrics import SpecDecodeMetrics
from thinkspec.utils import logger

if TYPE_CHECKING:
    from thinkspec.engine.engine import LLMEngine, PromptType


class EngineDeadError(RuntimeError):
    """The engine's step() failed; no request can run any more."""


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Snapshot of the engine taken on its thread after every step (safe to read from any thread)."""

    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks_used: int = 0
    num_kv_blocks_free: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (cumulative)
    prefix_cache_hits: int = 0  # of which found there
    spec_metrics: SpecDecodeMetrics | None = None  # cumulative; None when the engine does not speculate


class RequestStream:
    """Outputs of one request, from the engine thread to one asyncio consumer.

    Items are cumulative RequestOutputs (the last one has finished=True) or an exception.
    `token_gaps` holds the seconds between consecutive outputs that added tokens (the
    inter-token latencies, one per engine step as vLLM counts them).
    """

    __slots__ = ("request_id", "_loop", "_queue", "finished", "token_gaps", "_last_time", "_num_tokens")

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False
        self.token_gaps: list[float] = []
        self._last_time: float | None = None
        self._num_tokens = 0

    def put(self, item: RequestOutput | BaseException) -> None:
        """Called on the engine thread."""
        # RuntimeError: the event loop is closed, nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = item.finished
            self._time(item)
            yield item

    def _time(self, out: RequestOutput) -> None:
        n = sum(len(c.token_ids) for c in out.outputs)  # all n choices of the request
        if n <= self._num_tokens:
            return
        now = time.monotonic()
        if self._last_time is not None:
            self.token_gaps.append(now - self._last_time)
        self._last_time, self._num_tokens = now, n


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: Any
    params: SamplingParams
    stream: RequestStream
    ack: asyncio.Future[None]


def _resolve(fut: asyncio.Future[None], error: BaseException | None) -> None:
    # runs on the event loop; the waiter may have been cancelled meanwhile
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[_Add | str | None] = queue.SimpleQueue()  # str = abort id
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}  # touched on the engine thread only
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dead_error: str | None = None
        self.stats = EngineStats()

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("AsyncLLMEngine.start() called twice")
        self._update_stats()
        self._thread = threading.Thread(target=self._run, name="thinkspec-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the thread after its current step (unfinished requests are left as they are), then
        the engine's tensor-parallel workers."""
        self._stopping = True
        self._commands.put(None)
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            self.engine.shutdown()

    @property
    def is_healthy(self) -> bool:
        return self.dead_error is None and self._thread is not None and self._thread.is_alive()

    # ---- requests (event-loop side) -----------------------------------------------------------

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams) -> RequestStream:
        """Hand a request to the engine and wait until it is queued there.

        Raises what LLMEngine.add_request raises (ValueError for a prompt it cannot run) or
        EngineDeadError. If the caller is cancelled meanwhile the request is aborted.
        """
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, loop)
        ack: asyncio.Future[None] = loop.create_future()
        self._commands.put(_Add(request_id, prompt, params, stream, ack))
        self._wake.set()
        try:
            await ack
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    async def generate(
        self, prompt: PromptType, params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its cumulative outputs; closing or cancelling the iterator
        before the last output aborts the request (its KV blocks are freed)."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Thread-safe and idempotent; unknown or finished ids are ignored."""
        self._commands.put(request_id)
        self._wake.set()

    # ---- engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            self._wake.clear()
            try:
                self._drain_commands()
                if self._stopping:
                    break
                if self.dead_error is not None or not self.engine.has_unfinished_requests():
                    if self.dead_error is None:
                        self._update_stats()
                    self._wake.wait()
                    continue
                for out in self.engine.step():
                    stream = self._streams.get(out.request_id)
                    if stream is None:
                        continue
                    stream.put(out)
                    if out.finished:
                        del self._streams[out.request_id]
                self._update_stats()
            except Exception as e:  # noqa: BLE001 - a failure of the engine itself ends it
                self._die(e)

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd is None:
                continue
            if isinstance(cmd, str):
                if self.dead_error is None:
                    self.engine.abort_request(cmd)
                continue
            self._add(cmd)

    def _add(self, cmd: _Add) -> None:
        loop = cmd.stream._loop
        if self.dead_error is not None:
            loop.call_soon_threadsafe(_resolve, cmd.ack, EngineDeadError(self.dead_error))
            return
        try:
            self.engine.add_request(cmd.prompt, cmd.params, cmd.request_id)
        except Exception as e:  # noqa: BLE001 - the request fails alone, the engine goes on
            loop.call_soon_threadsafe(_resolve, cmd.ack, e)
            return
        self._streams[cmd.request_id] = cmd.stream
        loop.call_soon_threadsafe(_resolve, cmd.ack, None)

    def _die(self, error: Exception) -> None:
        logger.exception("the engine failed; failing all requests")
        self.dead_error = f"engine failed: {type(error).__name__}: {error}"
        for stream in self._streams.values():
            stream.put(EngineDeadError(self.dead_error))
        self._streams.clear()

    def _update_stats(self) -> None:
        engine = self.engine
        scheduler, blocks = engine.scheduler, engine.block_manager
        spec = getattr(engine, "spec_metrics", None)
        self.stats = EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_kv_blocks_used=blocks.num_used_blocks,
            num_kv_blocks_free=blocks.num_free_blocks,
            num_preemptions=scheduler.num_preemptions,
            prefix_cache_queries=blocks.stats.queries_tokens,
            prefix_cache_hits=blocks.stats.hits_tokens,
            spec_metrics=None if spec is None else SpecDecodeMetrics().merge(spec),
        )
