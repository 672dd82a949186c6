"""`thinkspec serve` as a real process on a free loopback port, for tests.

Import from tests as `from server_process import serve_process` (pytest puts tests/ on sys.path).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from thinkspec.engine.engine import LLMEngine
from thinkspec.engine_args import EngineArgs
from thinkspec.entrypoints.async_engine import AsyncLLMEngine

STARTUP_TIMEOUT_S = 90.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_process(*args: str) -> Iterator[tuple[subprocess.Popen, str, Callable[[], str]]]:
    """Run `thinkspec serve ARGS --port P` until /health answers 200; yields (process, base URL,
    reader of the log's tail). The process is killed afterwards if it is still running."""
    port = free_port()
    cmd = [sys.executable, "-m", "thinkspec.entrypoints.cli", "serve", *args, "--port", str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

        def log_text() -> str:
            log.seek(0)
            return log.read().decode(errors="replace")[-4000:]

        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while True:
                assert proc.poll() is None, f"server exited with {proc.returncode}:\n{log_text()}"
                assert time.monotonic() < deadline, f"not ready after {STARTUP_TIMEOUT_S} s:\n{log_text()}"
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                        break
                time.sleep(0.2)
            yield proc, url, log_text
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@contextlib.contextmanager
def running_engine(**engine_args: Any) -> Iterator[AsyncLLMEngine]:
    """An AsyncLLMEngine over EngineArgs(**engine_args), started, and shut down afterwards."""
    engine = AsyncLLMEngine(LLMEngine(EngineArgs(**engine_args)))
    engine.start()
    try:
        yield engine
    finally:
        engine.shutdown()
