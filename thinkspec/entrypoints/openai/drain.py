"""Graceful drain: what the server does between SIGTERM/SIGINT and its exit.

1. `draining` turns on: every new HTTP request gets 503 `server_shutting_down` (guards.py).
2. Requests in flight (queued in the engine, not yet answered) may finish for `timeout` seconds.
3. Then (at once on a second signal: `hurry`) `closed` turns on and every request still in
   flight is aborted in the engine; its handler answers 503 `server_shutting_down`
   (non-streamed) or an error event then [DONE] (streamed): an "abort" finish that reaches a
   live client can only come from here.
4. The HTTP server then closes its connections and the process exits with status 0.
"""

from __future__ import annotations

import asyncio

from thinkspec.entrypoints.async_engine import AsyncLLMEngine
from thinkspec.utils import logger

# After the in-flight requests are aborted: how long their handlers get to write the last event.
FLUSH_TIMEOUT_S = 5.0
# The same after a second signal (hurry), which must exit at once.
HURRIED_FLUSH_S = 0.5


class Drain:
    """The drain state of one app; `active` holds the ids of the requests in flight."""

    def __init__(self) -> None:
        self.draining = False
        self.closed = False
        self.hurried = False  # a second signal: stop waiting, end what is in flight now
        self.active: set[str] = set()

    def hurry(self) -> None:
        """End the wait of a running drain now (called on the event loop)."""
        self.hurried = True

    async def run(self, engine: AsyncLLMEngine, timeout: float) -> None:
        """Steps 1-3 of the module docstring; returns when every handler has answered (or after
        FLUSH_TIMEOUT_S more)."""
        self.draining = True
        loop = asyncio.get_running_loop()
        logger.info("draining: %d requests in flight, %.1f s to finish", len(self.active), timeout)
        deadline = loop.time() + timeout
        while self.active and loop.time() < deadline and not self.hurried:
            await asyncio.sleep(0.02)
        self.closed = True
        if self.active:
            logger.warning("drain timeout: ending %d requests in flight with 503", len(self.active))
            for request_id in list(self.active):
                engine.abort(request_id)
        deadline = loop.time() + FLUSH_TIMEOUT_S
        hurried_at: float | None = None
        while self.active and loop.time() < deadline:
            if self.hurried and hurried_at is None:
                hurried_at = loop.time()
                deadline = min(deadline, hurried_at + HURRIED_FLUSH_S)
            await asyncio.sleep(0.02)
