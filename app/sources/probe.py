"""Which engine is at a URL: tcp:// is kvscope's own; http(s):// is asked (vLLM answers
/version and names its metrics vllm:, llama-server answers /props with its slots)."""
from __future__ import annotations

from kvscope.app.sources import http_get
from kvscope.app.sources.source import KINDS

PROBE_TIMEOUT_S = 3.0


class ProbeError(ValueError):
    pass


def _json(reply: http_get.Reply):
    try:
        return reply.json("reply") if reply.status == 200 else None
    except http_get.BadPayload:
        return None


def probe(url: str, timeout: float = PROBE_TIMEOUT_S) -> str:
    """One of source.KINDS; ProbeError says what was tried when nothing fits."""
    if url.startswith("tcp://"):
        return "kvscope"
    if not url.startswith(("http://", "https://")):
        raise ProbeError(f"{url!r}: expected tcp://HOST:PORT (kvscope) or http(s)://HOST:PORT "
                         "(vLLM, llama-server)")
    base = url.rstrip("/")
    tried = []
    try:
        version = _json(http_get.get(base + "/version", timeout, 1 << 16))
        if isinstance(version, dict) and "version" in version:
            return "vllm"
        tried.append("/version")
        props = _json(http_get.get(base + "/props", timeout, 4 << 20))
        if isinstance(props, dict) and ("default_generation_settings" in props
                                        or "total_slots" in props):
            return "llama-server"
        tried.append("/props")
        metrics = http_get.get(base + "/metrics", timeout, 16 << 20)
        if metrics.status == 200 and b"vllm:" in metrics.body:
            return "vllm"
        if metrics.status == 200 and b"llamacpp:" in metrics.body:
            return "llama-server"
        tried.append("/metrics")
    except http_get.Unreachable as exc:
        raise ProbeError(f"nothing answered at {url} ({exc}); name the engine with --engine "
                         f"{'|'.join(KINDS)} to watch it until it comes up") from None
    raise ProbeError(f"{url} is neither vLLM nor llama-server (tried {', '.join(tried)}); "
                     f"name it with --engine {'|'.join(KINDS)}")
