"""Checks every HTTP request passes before any route sees it (an ASGI middleware, first in line).

- While the server drains (after SIGTERM/SIGINT): 503 `server_shutting_down`, every route.
- Host: when the server is bound to loopback, a Host header naming anything but a loopback name
  is refused (400 `invalid_host`): a web page whose DNS name was rebound to 127.0.0.1 reaches
  the port with its own name in Host.
- Origin: a browser request whose Origin is not in --allowed-origins is refused (403
  `origin_not_allowed`); with no allowed origins every browser origin is.
- POST bodies must be declared JSON (`application/json` or `application/*+json`), else 415
  `unsupported_media_type`: browsers send text/plain, form and typeless bodies cross-origin
  without asking (no CORS preflight), JSON never.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from fastapi.responses import JSONResponse

from thinkspec.entrypoints.openai.protocol import OpenAIError

LOOPBACK_HOSTS = frozenset({"localhost", "ip6-localhost"})  # names; addresses are parsed

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


def is_loopback(host: str) -> bool:
    """Whether a bind address or Host name means this machine only."""
    host = host.strip("[]").lower()
    if host in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback  # 127.0.0.0/8, ::1
    except ValueError:  # a DNS name ("127.0.0.1.evil.example" is one)
        return False


def host_name(header: str) -> str:
    """The name of a Host header, without its port: "[::1]:8000" -> "::1", "a.b:80" -> "a.b"."""
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def is_json_media_type(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class RequestGuard:
    """ASGI middleware applying the module's checks.

    draining: a callable telling whether the server drains; loopback_only: refuse non-loopback
    Host names; allowed_origins: browser origins allowed ("*" = any).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        draining: Callable[[], bool],
        loopback_only: bool,
        allowed_origins: Iterable[str] = (),
    ) -> None:
        self.app = app
        self.draining = draining
        self.loopback_only = loopback_only
        self.allowed_origins = frozenset(o.rstrip("/") for o in allowed_origins)

    def refusal(self, scope: Scope) -> OpenAIError | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.draining():
            return OpenAIError("the server is shutting down", status=503, code="server_shutting_down")
        host = headers.get("host")
        if self.loopback_only and host is not None and not is_loopback(host_name(host)):
            return OpenAIError(
                f"Host {host[:100]!r} is not a loopback name; this server answers loopback names only",
                code="invalid_host",
            )
        origin = headers.get("origin")
        if (
            origin is not None
            and "*" not in self.allowed_origins
            and origin.rstrip("/") not in self.allowed_origins
        ):
            return OpenAIError(
                f"Origin {origin[:100]!r} is not allowed (--allowed-origins)",
                status=403,
                code="origin_not_allowed",
            )
        if scope.get("method") == "POST" and not is_json_media_type(headers.get("content-type", "")):
            shown = headers.get("content-type", "none")[:100]
            return OpenAIError(
                f"POST bodies must be JSON (Content-Type: application/json), got {shown!r}",
                status=415,
                code="unsupported_media_type",
            )
        return None

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            error = self.refusal(scope)
            if error is not None:
                await JSONResponse(error.to_dict(), status_code=error.status)(scope, receive, send)
                return
        await self.app(scope, receive, send)
