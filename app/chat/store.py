"""Where conversations live: one JSON Lines file each in the user's data folder.

Every event is appended and flushed as it happens, so a crash loses at most the reply in
flight (its message is written once it ends). The folder is $XDG_DATA_HOME/kvscope/chats
(QStandardPaths' GenericDataLocation, ~/.local/share on Linux), so tests point it at a
temporary folder. Deleting moves the file to a ".deleted" name that undo moves back; the
deleted files are removed at the next start.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import IO

from PySide6.QtCore import QStandardPaths

from kvscope.app.chat.conversation import (
    BadConversation,
    Conversation,
    Event,
    Header,
    encode,
    read_events,
)

SUFFIX = ".jsonl"
DELETED = ".deleted"
_SAFE_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def default_folder() -> Path:
    base = QStandardPaths.writableLocation(
        QStandardPaths.StandardLocation.GenericDataLocation)
    return Path(base or Path.home() / ".local" / "share") / "kvscope" / "chats"


def attached_folder(kind: str, url: str) -> Path:
    """The chats of an attached engine (vLLM, llama-server), one folder per engine kind and
    address, beside the main window's (which load_all never reads: it globs its own files).
    The name is made of the address's plain characters only: a URL is never a path."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{kind}-{url.split('://', 1)[-1]}").strip("_.")
    return default_folder() / "attached" / (name[:120] or kind or "engine")


class ChatStore:
    def __init__(self, folder: Path | None = None) -> None:
        self.folder = Path(folder) if folder is not None else default_folder()
        self._files: dict[str, IO[bytes]] = {}

    def path(self, conversation_id: str) -> Path:
        if not _SAFE_ID.match(conversation_id):  # ids name files: never a path of their own
            raise ValueError(f"conversation id {conversation_id!r} is not a plain name")
        return self.folder / f"{conversation_id}{SUFFIX}"

    def load_all(self) -> tuple[list[Conversation], list[str]]:
        """Every saved conversation, oldest first, and the warnings (cut lines, refused
        files). Deleted files left by the last session are removed now."""
        if not self.folder.is_dir():
            return [], []
        for stale in self.folder.glob(f"*{SUFFIX}{DELETED}"):
            stale.unlink(missing_ok=True)
        out: list[Conversation] = []
        warnings: list[str] = []
        for path in self.folder.glob(f"*{SUFFIX}"):
            try:
                conversation, found = read_events(path.read_bytes(), path.name)
            except (BadConversation, OSError) as exc:
                warnings.append(f"not restored: {exc}")
                continue
            if conversation.id != path.name.removesuffix(SUFFIX):
                warnings.append(f"not restored: {path.name} holds conversation "
                                f"{conversation.id!r}")
                continue
            warnings += found
            if found:  # rewrite it whole, so that the next append starts on a clean line
                self.rewrite(conversation)
            out.append(conversation)
        out.sort(key=lambda c: c.created)
        return out, warnings

    def append(self, conversation_id: str, event: Event) -> None:
        f = self._files.get(conversation_id)
        if f is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            # Kept open across appends (one write and flush per event); close() closes it.
            f = open(self.path(conversation_id), "ab")  # noqa: SIM115
            self._files[conversation_id] = f
        f.write(encode(event))
        f.flush()

    def create(self, header: Header) -> None:
        self.append(header.id, header)

    def rewrite(self, conversation: Conversation) -> None:
        """The file anew from the state (header, then the messages), through a temporary
        file and a rename, so that a crash leaves the old file or the new one."""
        self.close(conversation.id)
        path = self.path(conversation.id)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(encode(conversation.header())
                        + b"".join(encode(m) for m in conversation.messages))
        os.replace(tmp, path)

    def delete(self, conversation_id: str) -> None:
        self.close(conversation_id)
        path = self.path(conversation_id)
        if path.exists():
            os.replace(path, path.with_name(path.name + DELETED))

    def undelete(self, conversation_id: str) -> bool:
        path = self.path(conversation_id)
        deleted = path.with_name(path.name + DELETED)
        if not deleted.exists():
            return False
        os.replace(deleted, path)
        return True

    def close(self, conversation_id: str | None = None) -> None:
        for cid in [conversation_id] if conversation_id else list(self._files):
            f = self._files.pop(cid, None)  # type: ignore[arg-type]
            if f is not None:
                f.close()
