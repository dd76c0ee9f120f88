"""Registers, stack and KV-loop spills of the Triton attention kernel, compiled for NVIDIA GPUs.

    python -m benchmarks.device.triton_registers [--caps 80 90] [--json]

It compiles on a machine without a GPU: Triton lowers to PTX and its bundled ptxas and
cuobjdump build and read the cubin, so no driver or device is needed.

The configuration is the engine's decode step on SmolLM2 (head_dim 64, GQA 3, 16-row query
tiles, 64-key tiles, bfloat16 dots, an int8 pool), and its prefill tile (64 rows), with and
without the rotation, the K balance and the anchor tokens, at 4 and 8 warps. Stack bytes > 0
mean local memory (spilled registers); what costs is a spill inside the KV loop, counted from
the SASS (local loads and stores between the loop's head and its backward branch).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

from kvscope.engine.measure.timing import add_json_flag, print_result

POINTERS = {"q_ptr": "*bf16", "k_cache_ptr": "*i8", "v_cache_ptr": "*i8",
            "block_tables_ptr": "*i64", "qsl_ptr": "*i32", "ctx_ptr": "*i32",
            "tile_seq_ptr": "*i32", "tile_q_ptr": "*i32", "out_ptr": "*bf16",
            "anchor_idx_ptr": "*i32"}
FLOATS = ("qk_scale", "v_fix")
VARIANTS = {
    "plain": {"ROTATE": False, "BALANCE": False, "ANCHOR_LEN": 0},
    "rotated": {"ROTATE": True, "BALANCE": False, "ANCHOR_LEN": 0},
    "calibrated": {"ROTATE": True, "BALANCE": True, "ANCHOR_LEN": 0},
    "calibrated+anchors": {"ROTATE": True, "BALANCE": True, "ANCHOR_LEN": 4},
}


def decode_constants(**overrides) -> dict:
    import triton.language as tl

    c = {"HEAD_DIM": 64, "BLOCK_SIZE": 16, "GROUP": 3, "GROUP_PAD": 4, "BLOCK_Q": 4,
         "BLOCK_N": 64, "BLOCK_D": 64, "NUM_SPLITS": 1, "KV_KIND": 1, "QUANT": True,
         "DOT": tl.bfloat16, "F32_PRECISION": "", "BF16_OUT": True, "ANCHOR_PAD": 16}
    c.update(overrides)
    return c


def resource_usage(cap: int, num_warps: int, constants: dict) -> dict:
    """{'REG': n, 'STACK': bytes, ..., 'LOOP_SPILLS': local loads/stores in the KV loop} of
    the kernel's cubin for compute capability `cap`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvscope.kernels.triton_attention import _paged_attention_kernel as kernel

    names = kernel.arg_names
    const_names = {p.name for p in kernel.params if p.is_constexpr}
    signature = {n: "constexpr" if n in const_names else
                 POINTERS.get(n, "*fp32" if n.endswith("_ptr") else
                              "fp32" if n in FLOATS else "i32") for n in names}
    source = ASTSource(kernel, signature,
                       constexprs={(names.index(k),): v for k, v in constants.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", cap, 32),
                              options={"num_warps": num_warps})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    line = next(line for line in usage.splitlines() if "REG:" in line)
    out = {k: int(v) for k, v in (part.split(":") for part in line.split()
                                  if ":" in part and part.split(":")[1].isdigit())}
    return {**out, "LOOP_SPILLS": loop_spills(sass)}


def loop_spills(sass: str) -> int:
    """Local-memory loads and stores inside the longest backward branch (the KV loop)."""
    code = [(int(m.group(1), 16), line) for line in sass.splitlines()
            if (m := re.search(r"/\*([0-9a-f]{4,})\*/\s+\S", line))]
    loops = [(int(m.group(1), 16), at) for at, line in code
             if (m := re.search(r"BRA (0x[0-9a-f]+)", line)) and int(m.group(1), 16) < at]
    if not loops:
        return 0
    lo, hi = max(loops, key=lambda span: span[1] - span[0])
    return sum(1 for at, line in code if lo <= at <= hi and ("LDL" in line or "STL" in line))


def format_table(rows: list[dict]) -> str:
    return "\n".join(f"sm_{r['sm']} {r['tile']:7} {r['variant']:20} {r['num_warps']} warps: "
                     f"{r['registers']:3d} registers, {r['stack_bytes']:4d} bytes stack, "
                     f"{r['loop_spills']} spill ops in the KV loop" for r in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="triton_registers", description=__doc__.split("\n")[0])
    p.add_argument("--caps", nargs="+", type=int, default=[80, 90])
    add_json_flag(p)
    args = p.parse_args(argv)
    rows = []
    for cap in args.caps:
        for tile, rows_per_seq in (("decode", 4), ("prefill", 16)):
            for name, variant in VARIANTS.items():
                for warps in (4, 8):
                    use = resource_usage(cap, warps,
                                         decode_constants(BLOCK_Q=rows_per_seq, **variant))
                    rows.append({"sm": cap, "tile": tile, "variant": name, "num_warps": warps,
                                 "registers": use.get("REG"), "stack_bytes": use.get("STACK"),
                                 "loop_spills": use["LOOP_SPILLS"]})
    print_result(rows, format_table, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
