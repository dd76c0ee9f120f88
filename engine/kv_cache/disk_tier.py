"""The disk tier: full KV blocks as files named by content digest, bounded, LRU, kept across
engine restarts.

A file is untrusted input (another process, an older version or a disk error may have written
it): a fixed binary header, the tier key as JSON, the block's token ids, then the raw bytes of
its tensors in block_copy.block_tensors' order. No pickle, nothing but numbers is decoded, and
every size is checked before a byte is used:

    magic "KVSCOPEB" | version u32 | key_len u32 | block digest 32 B | num_tokens u32 |
    payload_len u64 | sha256 of (key JSON + tokens + payload) 32 B | key JSON | tokens <i8 |
    payload

A file whose magic, version, key, digest, tokens, sizes or checksum do not match is refused
and deleted, never loaded; the log (logger "kvscope.kv_tiers", the reason in
`record.reason`) says why. Writes go to a temporary file renamed into place, so a crash leaves
no half block under a real name. A write that fails (a full disk, no permission) stops the
tier's writes, once logged; a request never fails for it.

The least recently used files go first when the byte budget needs room, whatever key they were
written under: blocks of another model or configuration are kept (switching back finds them)
until the budget reclaims them. The recency survives a restart as the files' mtimes.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import struct
import tempfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from kvscope.engine.kv_cache.block_copy import Layout
from kvscope.engine.kv_cache.tier_key import FORMAT_VERSION, TierKey

log = logging.getLogger("kvscope.kv_tiers")
MAGIC = b"KVSCOPEB"
HEADER = struct.Struct("<8sII32sIQ32s")
SUFFIX = ".kvb"
MAX_KEY_BYTES = 4096


def default_dir() -> Path:
    """Under the user's cache folder: $KVSCOPE_CACHE_DIR, else ~/.cache/kvscope."""
    env = os.environ.get("KVSCOPE_CACHE_DIR", "").strip()
    return (Path(env) if env else Path.home() / ".cache" / "kvscope") / "kv-blocks"


def payload_nbytes(layout: Layout) -> int:
    return sum(int(np.prod(shape)) * torch.empty(0, dtype=dt).element_size()
               for shape, dt in layout)


class DiskTier:
    def __init__(self, directory: Path, capacity_bytes: int, key: TierKey, layout: Layout
                 ) -> None:
        self.dir = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.key = key
        self.key_json = key.to_json().encode()
        self.layout = layout
        self.payload_len = payload_nbytes(layout)
        self.writes_stopped = ""  # why writes stopped ("" while they go on)
        self.refused: dict[str, int] = {}  # reason -> files refused and deleted
        self.num_written = self.num_loaded = 0
        self.bytes_written = self.bytes_loaded = 0
        self.index: OrderedDict[str, int] = OrderedDict()  # file name -> bytes, LRU first
        self.nbytes = 0
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._scan()
        except OSError as exc:
            self._stop(f"the folder {self.dir} is not usable ({exc})")

    @property
    def file_nbytes(self) -> int:
        """What one block of this key takes on disk."""
        return HEADER.size + len(self.key_json) + 8 * self.key.block_size + self.payload_len

    def __len__(self) -> int:
        return len(self.index)

    def contains(self, digest: bytes) -> bool:
        return _name(digest) in self.index

    def put(self, digest: bytes, token_ids: tuple[int, ...], payload: list[torch.Tensor]
            ) -> bool:
        """Write one block unless it is there already or writes stopped; False if not
        written (never raises)."""
        name = _name(digest)
        if name in self.index:
            self.index.move_to_end(name)
            return True
        if self.writes_stopped:
            return False
        size = self.file_nbytes
        if size > self.capacity_bytes:
            self._stop(f"one block ({size} bytes) is larger than --kv-disk-bytes")
            return False
        while self.nbytes + size > self.capacity_bytes and self.index:
            self._delete(next(iter(self.index)))
        tokens = np.asarray(token_ids, dtype="<i8").tobytes()
        raw = b"".join(_tensor_bytes(t) for t in payload)
        if len(raw) != self.payload_len:
            raise ValueError(f"a block of {len(raw)} bytes does not match the tier's layout "
                             f"({self.payload_len})")
        checksum = hashlib.sha256(self.key_json + tokens + raw).digest()
        header = HEADER.pack(MAGIC, FORMAT_VERSION, len(self.key_json), digest,
                             len(token_ids), len(raw), checksum)
        try:
            self._write_file(name, header + self.key_json + tokens + raw)
        except OSError as exc:
            self._stop(f"a write failed ({exc})")
            return False
        self.index[name] = size
        self.nbytes += size
        self.num_written += 1
        self.bytes_written += size
        return True

    def get(self, digest: bytes, token_ids: tuple[int, ...]) -> list[torch.Tensor] | None:
        """The block's tensors if its file is there and valid for this key, digest and tokens;
        None otherwise (a bad file is deleted and the reason logged)."""
        name = _name(digest)
        if name not in self.index:
            return None
        try:
            data = (self.dir / name).read_bytes()
        except OSError as exc:
            self._refuse(name, "unreadable", str(exc))
            return None
        reason, detail, offset = self._check(data, digest, token_ids)
        if reason:
            self._refuse(name, reason, detail)
            return None
        self.index.move_to_end(name)
        with contextlib.suppress(OSError):
            os.utime(self.dir / name)  # recency that survives a restart
        self.num_loaded += 1
        self.bytes_loaded += len(data)
        return _tensors(bytearray(data[offset:]), self.layout)

    def _check(self, data: bytes, digest: bytes, token_ids: tuple[int, ...]
               ) -> tuple[str, str, int]:
        """(reason, detail, payload offset); reason "" when the file is good."""
        if len(data) < HEADER.size:
            return "truncated", f"{len(data)} bytes, shorter than the header", 0
        magic, version, key_len, file_digest, n, payload_len, checksum = HEADER.unpack_from(data)
        if magic != MAGIC:
            return "bad-magic", f"magic {magic!r}", 0
        if version != FORMAT_VERSION:
            return "version", f"format version {version}, expected {FORMAT_VERSION}", 0
        if key_len > MAX_KEY_BYTES:
            return "bad-size", f"a key of {key_len} bytes", 0
        key = data[HEADER.size:HEADER.size + key_len]
        if key != self.key_json:
            return "key-mismatch", f"written under {key[:200]!r}", 0
        if file_digest != digest:
            return "digest-mismatch", "the header names another block", 0
        if n != len(token_ids) or payload_len != self.payload_len:
            return "bad-size", f"{n} tokens and {payload_len} bytes, expected " \
                               f"{len(token_ids)} and {self.payload_len}", 0
        start = HEADER.size + key_len
        offset = start + 8 * n
        if len(data) != offset + payload_len:
            return "truncated", f"{len(data)} bytes, expected {offset + payload_len}", 0
        if hashlib.sha256(data[HEADER.size:]).digest() != checksum:
            return "checksum", "the bytes do not match their checksum", 0
        tokens = np.frombuffer(data, dtype="<i8", count=n, offset=start)
        if tokens.tolist() != list(token_ids):
            return "token-mismatch", "the block holds other tokens", 0
        return "", "", offset

    def _write_file(self, name: str, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-", suffix=SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.dir / name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _scan(self) -> None:
        files = []
        for path in self.dir.glob("*" + SUFFIX):
            if path.name.startswith("."):
                path.unlink(missing_ok=True)  # a temporary file a crash left behind
                continue
            st = path.stat()
            files.append((st.st_mtime_ns, path.name, st.st_size))
        for _, name, size in sorted(files):
            self.index[name] = size
            self.nbytes += size
        while self.nbytes > self.capacity_bytes and self.index:
            self._delete(next(iter(self.index)))

    def _delete(self, name: str) -> None:
        self.nbytes -= self.index.pop(name, 0)
        with contextlib.suppress(OSError):
            (self.dir / name).unlink(missing_ok=True)

    def _refuse(self, name: str, reason: str, detail: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        log.warning("KV disk tier: refused and deleted %s: reason=%s (%s)", self.dir / name,
                    reason, detail, extra={"reason": reason, "path": str(self.dir / name)})
        self._delete(name)

    def _stop(self, why: str) -> None:
        if not self.writes_stopped:
            self.writes_stopped = why
            log.warning("KV disk tier: writes stopped: %s; requests go on without it", why,
                        extra={"reason": "writes-stopped"})


def _name(digest: bytes) -> str:
    return digest.hex() + SUFFIX


def _tensor_bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def _tensors(buf: bytearray, layout: Layout) -> list[torch.Tensor]:
    """The payload's tensors, each size checked against the layout."""
    out: list[torch.Tensor] = []
    offset = 0
    for shape, dtype in layout:
        n = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
        if offset + n > len(buf):
            raise ValueError("a disk block is shorter than its layout")
        # Cloned: the file's bytes sit at any offset, a tensor wants its own aligned memory.
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=offset).clone()
        out.append(raw.view(dtype).reshape(shape))
        offset += n
    return out
