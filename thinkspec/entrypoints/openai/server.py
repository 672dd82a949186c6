"""The OpenAI-compatible HTTP server (FastAPI + uvicorn): routes, auth, body limits, error objects.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /v1/models/{id},
POST /tokenize, POST /detokenize (these need the API key when one is set), GET /health, GET /ping,
GET /version, GET /metrics. Every error is an OpenAI error object:
{"error": {"message", "type", "param", "code"}}. Browser safety (Host, Origin, JSON bodies) is
guards.py's; the drain on SIGTERM/SIGINT is drain.py's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from types import FrameType
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from thinkspec.entrypoints.async_engine import AsyncLLMEngine
from thinkspec.entrypoints.openai.drain import Drain
from thinkspec.entrypoints.openai.guards import RequestGuard, is_loopback
from thinkspec.entrypoints.openai.metrics import ServerMetrics
from thinkspec.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    parse_json_body,
    parse_request,
)
from thinkspec.entrypoints.openai.serving import OpenAIServing, ServingConfig, off_loop
from thinkspec.entrypoints.openai.tokenization import DetokenizeRequest, detokenize, tokenize, tokenize_model
from thinkspec.entrypoints.openai.validation import check_body
from thinkspec.utils import logger

DEFAULT_MAX_REQUEST_BYTES = 1 << 20


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refusing (413) anything over `limit` bytes, declared or streamed."""
    too_large = OpenAIError(
        f"the request body exceeds the limit of {limit} bytes", status=413, code="request_too_large"
    )
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
    except ClientDisconnect:
        # Nobody is left to answer; one line instead of the tracebacks an unhandled error logs.
        logger.info(
            "%s %s: the client disconnected after %d of %s body bytes",
            request.method, request.url.path, len(body), length or "?",
        )  # fmt: skip
        gone = "the client disconnected before sending the whole body"
        raise OpenAIError(gone, code="client_disconnected") from None
    return bytes(body)


async def _wait_for_disconnect(request: Request) -> None:
    # The body is read already, so the next ASGI message can only be the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`; if the client goes away first, cancel it (which aborts its request)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):  # nobody is left to answer
        await task
    return Response(status_code=499)


def _error_response(e: OpenAIError) -> JSONResponse:
    return JSONResponse(e.to_dict(), status_code=e.status)


def build_app(
    engine: AsyncLLMEngine,
    config: ServingConfig,
    *,
    api_key: str | Sequence[str] | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    allowed_origins: Sequence[str] = (),
    loopback_only: bool = False,
    drain: Drain | None = None,
) -> FastAPI:
    """The app for one started AsyncLLMEngine; the caller owns the engine's lifecycle.

    api_key: one key or several (any of them is accepted); None or () = no key.
    allowed_origins: browser origins that get CORS headers ("*" = any; none: no CORS, and browser
    requests carrying an Origin are refused). loopback_only: refuse Host names that are not
    loopback names (for a server bound to loopback). drain: the state a graceful shutdown drives
    (app.state.drain; a fresh one by default).
    """
    if not isinstance(max_request_bytes, int) or max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be an integer >= 1, got {max_request_bytes!r}")
    keys = (api_key,) if isinstance(api_key, str) else tuple(api_key or ())
    if any(not isinstance(k, str) or not k for k in keys) or api_key == "":
        raise ValueError("api_key must be a non-empty string, a list of them, or None")
    metrics = ServerMetrics(engine)
    drain = drain or Drain()
    serving = OpenAIServing(engine, config, metrics, drain)
    app = FastAPI(title="thinkspec", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.drain = drain
    _install_guards(app, allowed_origins, loopback_only, drain)
    _install_error_handlers(app)
    check_api_key = _api_key_check(keys)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])
    _add_model_routes(v1, serving, int(time.time()))

    async def read_request(request: Request, model: Any) -> Any:
        """The validated body; `model` is the request class or a function of the body choosing it."""
        body = parse_json_body(await _read_body(request, max_request_bytes))
        check_body(body)
        return parse_request(model if isinstance(model, type) else model(body), body)

    async def respond(request: Request, handler: Any, model: type) -> Response:
        req = await read_request(request, model)
        if not req.stream:
            result = await _unless_disconnected(request, handler(req))
            return result if isinstance(result, Response) else JSONResponse(result)
        events: AsyncIterator[str] = await handler(req)
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await respond(request, serving.chat, ChatCompletionRequest)

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        return await respond(request, serving.completion, CompletionRequest)

    app.include_router(v1)

    # vLLM serves these outside /v1; here they need the key too, like everything that reads input.
    tok = APIRouter(dependencies=[Depends(check_api_key)])

    # Tokenizing a large body, and writing its long list of ids as JSON, take a while: off the
    # event loop, so other requests keep going (a Response skips FastAPI's slow jsonable_encoder).
    @tok.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        req = await read_request(request, tokenize_model)
        return await off_loop(lambda: JSONResponse(tokenize(serving, req)))

    @tok.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        req = await read_request(request, DetokenizeRequest)
        return await off_loop(lambda: JSONResponse(detokenize(serving, req)))

    app.include_router(tok)
    _install_public_routes(app, engine, metrics)
    return app


def _add_model_routes(router: APIRouter, serving: OpenAIServing, created: int) -> None:
    """GET /models (every served name) and /models/{id} (404 in OpenAI's shape for another id)."""
    config = serving.config

    def card(name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "thinkspec",
            "root": config.served_model_name,
            "max_model_len": serving.engine.engine.max_model_len,
        }

    @router.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card(name) for name in config.model_names]}

    @router.get("/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        serving.check_model(model_id)
        return card(model_id)


def _install_public_routes(app: FastAPI, engine: AsyncLLMEngine, metrics: ServerMetrics) -> None:
    """The routes that need no key: health (also as /ping, vLLM's name), version, metrics."""
    from thinkspec import __version__

    async def health() -> Response:
        if engine.is_healthy:
            return JSONResponse({"status": "ok"})
        reason = engine.dead_error or "the engine loop is not running"
        return _error_response(OpenAIError(reason, status=503, code="engine_dead"))

    app.get("/health")(health)
    app.get("/ping")(health)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _install_guards(app: FastAPI, allowed_origins: Sequence[str], loopback_only: bool, drain: Drain) -> None:
    if allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
    # Added last, so it runs first: refusals happen before CORS or any route.
    app.add_middleware(
        RequestGuard,
        draining=lambda: drain.draining,
        loopback_only=loopback_only,
        allowed_origins=allowed_origins,
    )


def _install_error_handlers(app: FastAPI) -> None:
    """Every error leaves in OpenAI's shape."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, e: OpenAIError) -> JSONResponse:
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed"}
        message = f"{request.method} {request.url.path}: {e.detail}"
        return _error_response(OpenAIError(message, status=e.status_code, code=codes.get(e.status_code)))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return _error_response(OpenAIError(str(e), code="invalid_request"))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return _error_response(OpenAIError(f"internal error: {type(e).__name__}", status=500))


def _api_key_check(keys: tuple[str, ...]) -> Any:
    """The dependency that checks the bearer token against any of `keys` (a no-op without keys)."""
    encoded = [k.encode() for k in keys]

    async def check_api_key(request: Request) -> None:
        if not encoded:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        given = token.strip().encode()
        # Every key is compared, so the time taken does not say which one came close.
        matches = [secrets.compare_digest(given, key) for key in encoded]
        if scheme.lower() != "bearer" or not any(matches):
            raise OpenAIError("missing or incorrect API key", status=401, code="invalid_api_key")

    return check_api_key


def _check_server_args(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if args.max_tokens_limit is not None and args.max_tokens_limit < 1:
        raise ValueError(f"--max-tokens-limit must be >= 1, got {args.max_tokens_limit}")
    if any(not key for key in args.api_key or ()):
        raise ValueError("--api-key must not be empty")
    if not 0 <= args.shutdown_timeout < float("inf"):
        raise ValueError(f"--shutdown-timeout must be a number of seconds >= 0, got {args.shutdown_timeout}")


API_KEY_ENV_VARS = ("THINKSPEC_API_KEY", "VLLM_API_KEY")


def api_keys(args: argparse.Namespace, environ: Mapping[str, str]) -> list[str]:
    """The --api-key values, else the first of API_KEY_ENV_VARS that is set and not empty."""
    if args.api_key:
        return list(args.api_key)
    for name in API_KEY_ENV_VARS:
        if environ.get(name):
            return [environ[name]]
    return []


def parse_origins(value: str | None) -> list[str]:
    """--allowed-origins "a,b" -> ["a", "b"]; None -> []."""
    return [o.strip() for o in (value or "").split(",") if o.strip()]


class _DrainingServer:
    """uvicorn.Server whose first SIGTERM/SIGINT drains (drain.py) before exiting with status 0;
    a second one exits at once. (A factory: uvicorn is imported only by run_server.)"""

    @staticmethod
    def make(config: Any, engine: AsyncLLMEngine, drain: Drain, timeout: float) -> Any:
        import uvicorn

        class Server(uvicorn.Server):
            async def serve(self, sockets: Any = None) -> None:
                self._drain_loop = asyncio.get_running_loop()
                self._drain_task: asyncio.Task[None] | None = None
                await super().serve(sockets)

            def handle_exit(self, sig: int, frame: FrameType | None) -> None:
                # Not recorded in _captured_signals: uvicorn would re-raise it after shutdown and
                # the default handler would end the process with the signal instead of status 0.
                loop = getattr(self, "_drain_loop", None)
                if loop is not None and self._drain_task is not None and not self.should_exit:
                    # A second signal while draining: end what is in flight now (each still gets
                    # its 503 or error event) and exit without waiting for connections.
                    logger.info("got %s again: ending the requests in flight", signal.Signals(sig).name)
                    self.force_exit = True
                    loop.call_soon_threadsafe(drain.hurry)
                    return
                if loop is None or self._drain_task is not None or self.should_exit:
                    self.force_exit = self.should_exit
                    self.should_exit = True
                    return
                logger.info("got %s: draining", signal.Signals(sig).name)
                drain.draining = True
                loop.call_soon_threadsafe(self._begin_drain)

            def _begin_drain(self) -> None:
                async def drain_then_exit() -> None:
                    try:
                        await drain.run(engine, timeout)
                    finally:
                        self.should_exit = True

                self._drain_task = asyncio.ensure_future(drain_then_exit())

        return Server(config)


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port, held from before the model loads until uvicorn serves on
    it; OSError naming --port when the port is taken. SO_REUSEADDR (as uvicorn sets it) lets a
    restart bind past the last run's TIME_WAIT connections; on Linux it never lets two sockets
    listen on one port, so listening at once holds the port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)  # uvicorn's default backlog
    except OSError as e:
        sock.close()
        raise OSError(
            e.errno,
            f"cannot listen on {host}:{port} ({e.strerror or e}); is another server using it? "
            "Choose another port with --port",
        ) from e
    sock.set_inheritable(True)
    return sock


def _log_speculation(config: Any) -> None:
    """One start-up line naming the draft and the speculation settings (those not at their default)."""
    spec = config.speculative_config
    if spec is None:
        logger.info("speculative decoding: off")
        return
    defaults = type(spec)().to_dict()
    settings = {k: v for k, v in spec.to_dict().items() if v != defaults[k]}
    logger.info("speculative decoding: %s", json.dumps(settings))


def run_server(args: argparse.Namespace) -> int:
    """`thinkspec serve`: build the engine from the engine flags, serve until interrupted."""
    import logging

    import uvicorn

    from thinkspec.engine_args import EngineArgs, engine_kwargs
    from thinkspec.llm import build_llm_engine

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sock = None
    try:
        _check_server_args(args)
        sock = listen_socket(args.host, args.port)  # before the model loads: a taken port fails fast
        llm_engine = build_llm_engine(EngineArgs(**engine_kwargs(args)))
    except (ValueError, FileNotFoundError, OSError) as e:
        if sock is not None:
            sock.close()
        print(f"thinkspec serve: error: {e}", file=sys.stderr)
        return 2
    _log_speculation(llm_engine.config)
    if args.max_tokens_limit is not None and args.max_tokens_limit > llm_engine.max_model_len:
        print(
            f"thinkspec serve: error: --max-tokens-limit {args.max_tokens_limit} exceeds max_model_len "
            f"{llm_engine.max_model_len}",
            file=sys.stderr,
        )
        llm_engine.shutdown()
        return 2
    names = args.served_model_name or [args.model]
    config = ServingConfig(
        served_model_name=names[0],
        max_tokens_limit=args.max_tokens_limit or llm_engine.max_model_len,
        other_model_names=tuple(names[1:]),
        reasoning_field=args.reasoning_field,
    )
    engine = AsyncLLMEngine(llm_engine)
    engine.start()
    drain = Drain()
    try:
        app = build_app(
            engine,
            config,
            api_key=api_keys(args, os.environ),
            max_request_bytes=args.max_request_bytes,
            allowed_origins=parse_origins(args.allowed_origins),
            loopback_only=is_loopback(args.host),
            drain=drain,
        )
        port = sock.getsockname()[1]  # the one the system chose for --port 0
        logger.info("serving %s on http://%s:%d", config.served_model_name, args.host, port)
        uv_config = uvicorn.Config(
            app, host=args.host, port=port, log_level="info", timeout_graceful_shutdown=5
        )
        _DrainingServer.make(uv_config, engine, drain, args.shutdown_timeout).run(sockets=[sock])
    finally:
        sock.close()
        engine.shutdown()
    return 0
