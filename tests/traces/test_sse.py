"""The event-stream parser on the line endings, comments and fields the spec allows, fed one
byte at a time as well as whole; bad bytes are an SseError, not a crash."""
import pytest

from kvscope.engine.traces import sse
from kvscope.engine.traces.openai_stream import ChunkError, read_chunk

STREAM = (b": keep-alive\r\ndata: {\"a\": 1}\r\n\r\nevent: x\nid: 3\ndata: two\ndata: lines\n\n"
          b"data:nospace\r\rdata: [DONE]\n\n")
EVENTS = ['{"a": 1}', "two\nlines", "nospace", "[DONE]"]


def test_whole_and_byte_by_byte_give_the_same_events():
    assert sse.SseParser().feed(STREAM) == EVENTS
    p = sse.SseParser()
    got = [e for k in range(len(STREAM)) for e in p.feed(STREAM[k:k + 1])]
    assert got == EVENTS and not p.pending()


def test_a_cut_event_is_pending_and_bad_bytes_are_errors(monkeypatch):
    p = sse.SseParser()
    assert p.feed(b"data: half") == [] and p.pending()
    with pytest.raises(sse.SseError, match="not UTF-8"):
        sse.SseParser().feed(b"data: \xff\xfe\n\n")
    monkeypatch.setattr(sse, "MAX_EVENT_BYTES", 64)
    with pytest.raises(sse.SseError, match="more than 64 bytes"):
        sse.SseParser().feed(b"data: " + b"x" * 100)


def test_chunks_of_either_api_and_errors():
    assert read_chunk('{"choices": [{"text": "hi", "finish_reason": null}]}').text == "hi"
    chat = read_chunk('{"choices": [{"delta": {"content": "yo"}, "finish_reason": "stop"}],'
                      ' "usage": {"prompt_tokens": 3, "completion_tokens": 1}, "x": 1}')
    assert (chat.text, chat.finish_reason, chat.completion_tokens) == ("yo", "stop", 1)
    assert read_chunk('{"error": {"message": "boom"}}').error == "boom"
    assert read_chunk('{"object": "error", "message": "old vllm"}').error == "old vllm"
    for bad in ("{nope", "[1, 2]", '{"choices": 3}'):
        with pytest.raises(ChunkError):
            read_chunk(bad)
