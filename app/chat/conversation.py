"""A saved conversation as data: its events on disk, its state, and its Markdown/JSON export.

A conversation file is JSON Lines, one event a line, only ever appended to: the header first,
then messages, settings changes, renames and truncations (regenerate and edit discard the
messages after the point they restart from: the old branch is not kept). Files are untrusted
input: every line decodes into one of the Structs below (msgspec, unknown fields refused) or
the file is refused with the line number and what was wrong; nothing is ever eval'd.
"""
from __future__ import annotations

import time
from typing import Literal

import msgspec

FORMAT_VERSION = 1
ROLES = ("user", "assistant")


class ChatSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The sampling a conversation's requests go out with (engine SamplingParams names)."""
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = []

    def sampling(self) -> dict:
        """The Submit sampling fields (seed and stop only when set)."""
        out = msgspec.structs.asdict(self)
        if self.seed is None:
            del out["seed"]
        if not self.stop:
            del out["stop"]
        return out


class _Event(msgspec.Struct, tag_field="event", forbid_unknown_fields=True, kw_only=True):
    pass


class Header(_Event, tag="header"):
    version: int
    id: str
    title: str
    created: float
    system_prompt: str = ""
    settings: ChatSettings = msgspec.field(default_factory=ChatSettings)


class Message(_Event, tag="message"):
    role: Literal["user", "assistant"]
    content: str
    stats: str = ""  # the reply's stats line as shown (assistant only)
    error: str = ""  # why the reply ended early, if it failed
    tokens: int = 0  # prompt + reply tokens of the request that wrote it (context meter)


class Retitle(_Event, tag="title"):
    title: str


class SetSystemPrompt(_Event, tag="system_prompt"):
    system_prompt: str


class SetSettings(_Event, tag="settings"):
    settings: ChatSettings


class Truncate(_Event, tag="truncate"):
    """Keep only the first `keep` messages (regenerate, edit-and-continue)."""
    keep: int = msgspec.field(default=0)


Event = Header | Message | Retitle | SetSystemPrompt | SetSettings | Truncate
_decoder = msgspec.json.Decoder(Event)
_encoder = msgspec.json.Encoder()


class BadConversation(ValueError):
    """A conversation file that cannot be read; the message names the line and the fault."""


def encode(event: Event) -> bytes:
    return _encoder.encode(event) + b"\n"


def decode_line(line: bytes) -> Event:
    return _decoder.decode(line)


class Conversation:
    """The state a conversation's events add up to."""

    def __init__(self, header: Header) -> None:
        if header.version != FORMAT_VERSION:
            raise BadConversation(f"format version {header.version} is not "
                                  f"{FORMAT_VERSION}, the one this kvscope reads")
        self.id = header.id
        self.title = header.title
        self.created = header.created
        self.system_prompt = header.system_prompt
        self.settings = header.settings
        self.messages: list[Message] = []

    @classmethod
    def new(cls, conversation_id: str, title: str,
            settings: ChatSettings | None = None) -> tuple[Conversation, Header]:
        header = Header(version=FORMAT_VERSION, id=conversation_id, title=title,
                        created=time.time(), settings=settings or ChatSettings())
        return cls(header), header

    def header(self) -> Header:
        """The header a rewritten file starts with (the current title, prompt, settings)."""
        return Header(version=FORMAT_VERSION, id=self.id, title=self.title,
                      created=self.created, system_prompt=self.system_prompt,
                      settings=self.settings)

    def apply(self, event: Event) -> None:
        if isinstance(event, Message):
            self.messages.append(event)
        elif isinstance(event, Retitle):
            self.title = event.title
        elif isinstance(event, SetSystemPrompt):
            self.system_prompt = event.system_prompt
        elif isinstance(event, SetSettings):
            self.settings = event.settings
        elif isinstance(event, Truncate):
            if not 0 <= event.keep <= len(self.messages):
                raise BadConversation(f"truncate keep={event.keep} outside the "
                                      f"{len(self.messages)} messages")
            del self.messages[event.keep:]
        else:
            raise BadConversation("a second header")

    def prompt_messages(self) -> list[dict]:
        """The messages a request sends: the system prompt (if any), then the transcript."""
        out = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return out + [{"role": m.role, "content": m.content} for m in self.messages]

    # -- export ---------------------------------------------------------------------------------
    def to_json(self) -> bytes:
        doc = {"title": self.title, "created": self.created, "system_prompt": self.system_prompt,
               "settings": msgspec.structs.asdict(self.settings),
               "messages": [{"role": m.role, "content": m.content} for m in self.messages]}
        return msgspec.json.format(msgspec.json.encode(doc), indent=2) + b"\n"

    def to_markdown(self) -> str:
        parts = [f"# {self.title}", ""]
        if self.system_prompt:
            parts += ["**System:**", "", self.system_prompt, ""]
        for m in self.messages:
            parts += ["**You:**" if m.role == "user" else "**Assistant:**", "", m.content, ""]
        return "\n".join(parts)


def read_events(data: bytes, name: str) -> tuple[Conversation, list[str]]:
    """A conversation from a file's bytes, and the warnings met. A last line without its
    newline was cut by a crash mid-write: it is dropped with a warning, the lines before it
    kept. Any other bad line refuses the file (BadConversation naming the line)."""
    lines = data.split(b"\n")
    warnings: list[str] = []
    if lines and lines[-1] == b"":
        lines.pop()
    elif lines:
        tail = lines.pop()
        warnings.append(f"{name}: the last line ({len(tail)} bytes) was cut short, "
                        "probably by a crash while it was written; dropped")
    if not lines:
        raise BadConversation(f"{name}: no header line")
    conversation: Conversation | None = None
    for number, line in enumerate(lines, 1):
        try:
            event = decode_line(line)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise BadConversation(f"{name}, line {number}: {exc}") from None
        try:
            if conversation is None:
                if not isinstance(event, Header):
                    raise BadConversation("the first line is not the header")
                conversation = Conversation(event)
            else:
                conversation.apply(event)
        except BadConversation as exc:
            raise BadConversation(f"{name}, line {number}: {exc}") from None
    assert conversation is not None
    return conversation, warnings
