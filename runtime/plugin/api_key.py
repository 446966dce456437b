"""The served endpoint's API key: where it comes from, and the ASGI middleware that demands it on every route.

vLLM's own ``--api-key`` check guards only paths under ``/v1``, ``/v2`` and ``/inference``; ``/invocations``,
``/tokenize``, ``/metrics``, ``/load``, ``/scale_elastic_ep``, ``/docs`` and the rest stay open. This middleware is
loaded through vLLM's own ``--middleware`` option, which adds it after vLLM's middleware, so it is the outermost
one: every HTTP request and WebSocket handshake passes through it before any route, and everything except
``GET``/``HEAD /health`` needs ``Authorization: Bearer <key>``.

The key is read from the environment only, never from argv (argv is in every process listing and vLLM logs its
non-default arguments): ``S4KV_API_KEY_FILE`` names a file holding it, or ``VLLM_API_KEY`` holds it.
Stdlib only: the middleware is plain ASGI.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any, Awaitable, Callable, Mapping

KEY_FILE_ENV = "S4KV_API_KEY_FILE"
KEY_ENV = "VLLM_API_KEY"
MIDDLEWARE = f"{__name__}.ApiKeyMiddleware"  # the --middleware value vLLM imports
OPEN_PATH = "/health"  # the liveness probe of load balancers and monitors: 200 or 503, nothing about the model
OPEN_METHODS = ("GET", "HEAD")

Scope = Mapping[str, Any]
Receive = Callable[[], Awaitable[Mapping[str, Any]]]
Send = Callable[[Mapping[str, Any]], Awaitable[None]]


def configured_api_key(environ: Mapping[str, str] = os.environ) -> str | None:
    """The API key from the environment, or None when none is set. Raises ValueError (one sentence) when the
    settings are unusable: both variables set, or the file unreadable, empty or holding more than one line."""
    path, inline = environ.get(KEY_FILE_ENV), environ.get(KEY_ENV)
    if path and inline:
        raise ValueError(f"set either {KEY_FILE_ENV} or {KEY_ENV}, not both.")
    if not path:
        return inline or None
    try:
        with open(path, encoding="utf-8") as handle:
            key = handle.read().rstrip("\r\n")
    except OSError as err:
        raise ValueError(f"{KEY_FILE_ENV} names {path}, which cannot be read ({err.strerror}).") from None
    if not key.strip():
        raise ValueError(f"{KEY_FILE_ENV} names {path}, which holds no key.")
    if "\n" in key or key != key.strip():
        raise ValueError(f"{KEY_FILE_ENV} names {path}, which must hold the key alone on one line.")
    return key


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8")).digest()


class ApiKeyMiddleware:
    """Pure ASGI middleware: 401 for any request without the right bearer token, except ``GET /health``."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        key = configured_api_key()
        if key is None:
            raise ValueError(f"{MIDDLEWARE} needs {KEY_FILE_ENV} or {KEY_ENV} set in the server's environment.")
        self.app = app
        self._key_digest = _digest(key)  # compared as digests, in constant time

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self._is_open(scope) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation, before the handshake
            return
        body = json.dumps({"error": "Unauthorized"}).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer"),
        ]})
        await send({"type": "http.response.body", "body": body})

    @staticmethod
    def _is_open(scope: Scope) -> bool:
        # The exact path only: "/health/", "//health" or "/health/../x" need the key like everything else.
        path = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        return scope["type"] == "http" and path == OPEN_PATH and scope.get("method") in OPEN_METHODS

    def _authorized(self, scope: Scope) -> bool:
        values = [value for name, value in scope.get("headers", ()) if name.lower() == b"authorization"]
        if len(values) != 1:  # none, or several that proxies and frameworks might read differently
            return False
        scheme, _, token = values[0].decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(_digest(token), self._key_digest)
