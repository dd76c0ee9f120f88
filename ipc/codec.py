"""Encoding and decoding with the typed msgspec decoders; hostile input becomes BadMessage.

msgspec encoders/decoders hold no per-call state, so the module-level ones are shared by threads.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

import msgspec

from kvscope.ipc import messages as m

if TYPE_CHECKING:  # what msgspec decodes from: bytes, a zmq frame, anything with a buffer
    from typing_extensions import Buffer

StateFrame = m.StepFrame | m.BlocksFrame | m.StatsFrame | m.DeviceFrame | m.Heartbeat
_Result = TypeVar("_Result")

_encoder = msgspec.msgpack.Encoder()
# Declared types: msgspec types a decoder of a union (or of a `type` value) as Decoder[Any].
_command_decoder: msgspec.msgpack.Decoder[m.Command] = msgspec.msgpack.Decoder(m.Command)
_reply_decoder: msgspec.msgpack.Decoder[m.Reply] = msgspec.msgpack.Decoder(m.Reply)
_state_decoders: dict[str, msgspec.msgpack.Decoder[StateFrame]] = {
    topic: msgspec.msgpack.Decoder(t) for topic, t in m.TOPIC_TYPES.items()}


class BadMessage(Exception):
    """A frame that is not a valid message; `call_id` is set when the sender can be told which
    of its calls failed."""

    def __init__(self, code: str, message: str, call_id: int | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.call_id = code, message, call_id


class _IdOnly(msgspec.Struct):
    id: m.CallId


def encode(obj: object) -> bytes:
    return _encoder.encode(obj)


def decode_command(buf: Buffer) -> m.Command:
    try:
        return _command_decoder.decode(buf)
    except msgspec.ValidationError as exc:
        text = str(exc)
        code = m.UNKNOWN_TYPE if "`$.type`" in text or "field `type`" in text else m.INVALID
        raise BadMessage(code, text, _salvage_id(buf)) from None
    except (msgspec.DecodeError, RecursionError, MemoryError, ValueError, TypeError) as exc:
        raise BadMessage(m.MALFORMED, f"not a msgpack message: {exc}") from None


def _salvage_id(buf: Buffer) -> int | None:
    """The call id of a message that failed validation, so the error reaches the right call."""
    try:
        return msgspec.msgpack.decode(buf, type=_IdOnly).id
    except Exception:  # noqa: BLE001 - anything at all means "no id"
        return None


def decode_reply(buf: Buffer) -> m.Reply:
    return _reply_decoder.decode(buf)


def decode_result(raw: msgspec.Raw, result_type: type[_Result]) -> _Result:
    return msgspec.msgpack.decode(raw, type=result_type)


def decode_state(topic: str, buf: Buffer) -> StateFrame:
    """A state frame of `topic`, every field present and of its type (msgspec is strict: no
    coercion); anything else is BadMessage(INVALID) naming the field, e.g. `$.engine.kv_dtype`."""
    decoder = _state_decoders.get(topic)
    if decoder is None:
        raise BadMessage(m.UNKNOWN_TYPE, f"no state topic {topic!r}: expected one of {m.TOPICS}")
    try:
        return decoder.decode(buf)
    except msgspec.ValidationError as exc:
        raise BadMessage(m.INVALID, f"bad {topic} frame: {exc}") from None
    except (msgspec.DecodeError, RecursionError, MemoryError, ValueError, TypeError) as exc:
        raise BadMessage(m.MALFORMED, f"bad {topic} frame: not msgpack: {exc}") from None
