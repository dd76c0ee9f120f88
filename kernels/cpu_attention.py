"""The CPU decode attention kernel (kernels/cpu_decode_attention.c): built on first use with
the system C compiler, loaded with ctypes, called once per layer for every decode row.

Why native code: the torch path gathers each sequence's blocks into a padded copy, converts
it to float32 and runs SDPA over it, three passes and a dozen ops per layer; the kernel reads
every cached K and V row once, through the block table, with no copies and no padding. It is
plain C (no torch headers), so it builds in about a second with `cc -O3 -march=native`, into
a cache folder keyed by the source, the compiler and the flags. Where no compiler works,
`available()` is False and the engine keeps the torch reference (kernels.ops decides);
`KVSCOPE_CPU_KERNELS=off` forces that. Prefill chunks always take the reference path.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kernels.attention_ref import AttentionMetadata, paged_attention_ref

SOURCE = Path(__file__).with_name("cpu_decode_attention.c")
ENV = "KVSCOPE_CPU_KERNELS"
FLAG_SETS = (["-O3", "-march=native", "-fopenmp-simd"], ["-O3", "-fopenmp-simd"], ["-O2"])
KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3,
         torch.float8_e4m3fn: 4}
# Below this many decode rows a second thread costs more to hand work to than it saves.
SPLIT_MIN_ROWS = 4


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvscope" / "kernels"


def enabled() -> bool:
    return os.environ.get(ENV, "").strip().lower() not in ("off", "0", "false", "no")


@functools.cache
def _library() -> ctypes.CDLL | None:
    """Build (once per source/compiler/flags) and load the kernel; None if that fails."""
    compiler = os.environ.get("CC", "cc")
    source = SOURCE.read_bytes()
    for flags in FLAG_SETS:
        key = hashlib.sha256(source + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
        target = cache_dir() / f"cpu_decode_attention-{key}.so"
        if not target.exists() and not _build(compiler, flags, target):
            continue
        try:
            lib = ctypes.CDLL(str(target))
        except OSError:
            continue
        lib.kvscope_init_tables()
        fn = lib.kvscope_paged_decode
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                       ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 4 + [
                       ctypes.c_int, ctypes.c_float]
        return lib
    return None


def _build(compiler: str, flags: list[str], target: Path) -> bool:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: parallel test processes never load half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [compiler, *flags, "-shared", "-fPIC", str(SOURCE), "-o", tmp, "-lm"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"kvscope: building the CPU attention kernel failed ({e})", file=sys.stderr)
        os.unlink(tmp)
        return False
    if done.returncode != 0:
        print(f"kvscope: {' '.join(cmd)} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
        os.unlink(tmp)
        return False
    os.replace(tmp, target)
    return True


def available() -> bool:
    return enabled() and _library() is not None


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (query.device.type == "cpu" and k_cache.dtype in KINDS and k_cache.is_contiguous()
            and available())


@functools.cache
def _executor() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvscope-attn")


def paged_attention_cpu(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float,
                        k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """As kernels.attention_ref.paged_attention_ref: decode rows through the kernel, prefill
    chunks through the reference."""
    rows, seqs, lens = decode_rows(meta)
    if not len(rows):
        return paged_attention_ref(query, k_cache, v_cache, meta, scale, k_scale, v_scale)
    q = query.float().contiguous()
    out = torch.empty_like(q)
    if meta.prefill_seqs:
        out[:] = paged_attention_ref(query, k_cache, v_cache, _prefill_only(meta), scale,
                                     k_scale, v_scale)
    tables = meta.block_tables.index_select(0, seqs) if len(seqs) < len(meta.context_lens) \
        else meta.block_tables
    _run(out, q, rows, tables.contiguous(), lens, k_cache, v_cache, k_scale, v_scale, scale)
    return out.to(query.dtype)


def decode_rows(meta: AttentionMetadata):
    """(query rows, sequence indices, context lengths) of the step's decode rows, int64,
    worked out once per step and kept on `meta`."""
    got = meta.__dict__.get("_cpu_decode_rows")
    if got is None:
        qsl, ctx = meta.query_start_loc, meta.context_lens
        idx = [i for i in range(len(ctx)) if qsl[i + 1] - qsl[i] == 1]
        got = tuple(torch.tensor(x, dtype=torch.long) for x in
                    ([qsl[i] for i in idx], idx, [ctx[i] for i in idx]))
        meta.__dict__["_cpu_decode_rows"] = got
    return got


def _prefill_only(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(meta.query_start_loc, meta.context_lens, meta.block_tables,
                             meta.slot_mapping, [], meta.prefill_seqs, meta.rotation)


def _run(out, q, rows, tables, lens, k_cache, v_cache, k_scale, v_scale, scale) -> None:
    lib = _library()
    _, block_size, kv_heads, head_dim = k_cache.shape
    ptr = lambda t: None if t is None else t.data_ptr()
    def call(first: int, last: int) -> int:
        return lib.kvscope_paged_decode(
            out.data_ptr(), q.data_ptr(), rows.data_ptr(), tables.data_ptr(), tables.shape[1],
            lens.data_ptr(), first, last, k_cache.data_ptr(), v_cache.data_ptr(),
            ptr(k_scale), ptr(v_scale), q.shape[1], kv_heads, head_dim, block_size,
            KINDS[k_cache.dtype], scale)
    n = len(rows)
    if n >= SPLIT_MIN_ROWS and torch.get_num_threads() > 1:
        # ctypes lets go of the GIL during the call: the two halves run side by side.
        half = _executor().submit(call, n // 2, n)
        status = call(0, n // 2) | half.result()
    else:
        status = call(0, n)
    if status:
        raise MemoryError("the CPU attention kernel could not allocate its score buffer")
