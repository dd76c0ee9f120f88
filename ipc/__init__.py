"""What the engine process and its front ends share: message types, endpoints, the client.

Depends on pyzmq and msgspec only (never torch, Qt or the engine).
"""
from kvscope.ipc.client import Completion, EngineClient, EngineDead, EngineError, EngineTimeout
from kvscope.ipc.messages import PROTOCOL_VERSION, TOPICS

__all__ = ["PROTOCOL_VERSION", "TOPICS", "Completion", "EngineClient", "EngineDead",
           "EngineError", "EngineTimeout"]
