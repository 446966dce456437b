"""The API-key middleware on the ASGI scope kinds the CPU test server does not exercise (its tiny model serves no
WebSocket route): WebSocket handshakes are closed without the key, lifespan events pass, and the middleware refuses
to start without a key. The HTTP behaviour is tested against the real server in test_served_endpoint.py."""

from __future__ import annotations

import asyncio

import pytest

from s4kv.runtime.plugin.api_key import ApiKeyMiddleware

KEY = "k-123"


def run(middleware: ApiKeyMiddleware, scope: dict) -> tuple[list[dict], list[str]]:
    sent, reached = [], []

    async def app(scope, receive, send):
        reached.append(scope["type"])

    async def receive():
        return {"type": f"{scope['type']}.connect"}

    async def send(message):
        sent.append(message)

    middleware.app = app
    asyncio.run(middleware(scope, receive, send))
    return sent, reached


@pytest.fixture
def middleware(monkeypatch):
    monkeypatch.delenv("S4KV_API_KEY_FILE", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    return ApiKeyMiddleware(app=None)


def websocket(path: str, headers: list) -> dict:
    return {"type": "websocket", "path": path, "headers": headers}


def test_websocket_needs_the_key(middleware):
    sent, reached = run(middleware, websocket("/v1/realtime", []))
    assert sent == [{"type": "websocket.close", "code": 1008}] and reached == []
    sent, reached = run(middleware, websocket("/health", []))  # /health is open to HTTP GET only
    assert reached == []
    sent, reached = run(middleware, websocket("/v1/realtime", [(b"authorization", f"Bearer {KEY}".encode())]))
    assert sent == [] and reached == ["websocket"]


def test_lifespan_passes(middleware):
    assert run(middleware, {"type": "lifespan"})[1] == ["lifespan"]


def test_root_path_is_honoured_for_health_only(middleware):
    scope = {"type": "http", "method": "GET", "path": "/api/health", "root_path": "/api", "headers": []}
    assert run(middleware, scope)[1] == ["http"]
    sent, reached = run(middleware, dict(scope, path="/api/v1/models"))
    assert reached == [] and sent[0]["status"] == 401


def test_no_key_no_middleware(monkeypatch):
    monkeypatch.delenv("S4KV_API_KEY_FILE", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(ValueError, match="needs S4KV_API_KEY_FILE or VLLM_API_KEY"):
        ApiKeyMiddleware(app=None)
