"""Prometheus for the HTTP API: `http_requests_total{method, endpoint, status}` (the name
vLLM's API server exposes) and the engine's metrics on the API's own port at /metrics."""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route


class CountRequests:
    """ASGI middleware: count every response by method, endpoint and status. Paths that are
    no endpoint count as "other", so a scanner cannot grow the label set without bound."""

    def __init__(self, app, counter: Counter, endpoints: frozenset[str]) -> None:
        self.app, self.counter, self.endpoints = app, counter, endpoints

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # what the client sees if the app fails before answering

        async def send_counting(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counting)
        finally:
            path = scope["path"]
            endpoint = path if path in self.endpoints else "other"
            method = scope["method"] if scope["method"] in ("GET", "POST") else "other"
            self.counter.labels(method, endpoint, str(status)).inc()


def request_counter(registry) -> Counter:
    return Counter("http_requests", "HTTP requests by method, endpoint and status",
                   ["method", "endpoint", "status"], registry=registry)


def metrics_route(registry) -> Route:
    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
    return Route("/metrics", metrics, methods=["GET"])
