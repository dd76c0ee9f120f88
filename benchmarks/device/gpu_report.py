"""gpu_check's report as text: correctness per kernel case, decode bandwidth, the engine end
to end against Hugging Face, and the device panel's numbers beside nvidia-smi's."""
from __future__ import annotations


def format_report(r: dict) -> str:
    lines = [f"device: {r['device']}"]
    if r.get("checks"):
        lines += ["", "correctness (Triton vs torch reference)"]
    for c in r.get("checks", []):
        status = "ok  " if c["ok"] else "FAIL"
        if c["kernel"] == "kv_write":
            lines.append(f"  {status} kv_write   {c['kv_dtype']:>8} <- {c['src_dtype']:<8} "
                         f"block {c['block_size']:>3}: {c['mismatched_elements']} mismatched "
                         f"elements, {c['wrongly_touched_slots']} wrong slots (exact)")
        elif "error" in c:
            lines.append(f"  FAIL {c['kernel']} {c['kv_dtype']} q {c['q_dtype']} block "
                         f"{c['block_size']} heads {c['heads']}: {c['error']}")
        else:
            name = {"paged_attention rotated": "attn+rot ",
                    "paged_attention rotated balanced": "attn+bal "}.get(c["kernel"],
                                                                         "attention")
            if " window" in c["kernel"] or " softcap" in c["kernel"]:
                name = "attn+win "
            if " verify" in c["kernel"]:
                name = "attn+ver "
            lines.append(f"  {status} {name}  {c['kv_dtype']:>8} q {c['q_dtype']:<8} "
                         f"block {c['block_size']:>3} heads {c['heads']:<9} splits "
                         f"{c['num_splits']!s:>4}: max err {c['max_abs_err']:.2e} "
                         f"(tol {c['tolerance']:.0e}, {c['err_over_tol']:.2f} of it), "
                         f"NaN {c['nan_outputs']}")
    if r.get("gpu_skipped"):
        lines += ["", f"GPU part skipped: {r['gpu_skipped']}"]
    if r.get("decode"):
        lines += ["", f"device-to-device copy bandwidth: {r['copy_gb_per_s']:.0f} GB/s "
                  "(read + write)", "", "paged decode attention (block size 16, bf16 queries)",
                  (f"  {'config':<26} {'kv':>8} {'batch':>5} {'ctx':>6} {'splits':>6} "
                   f"{'ms':>8} {'GB read':>8} {'GB/s':>7} {'of copy':>8} {'ref ms':>8}")]
    for d in r.get("decode", []):
        if "error" in d:
            lines.append(f"  {d['config']:<26} {d['kv_dtype']:>8} {d['batch']:>5} "
                         f"{d['context']:>6}: {d['error']}")
            continue
        ref = d["ref_ms"]
        ref = f"{ref:8.2f}" if isinstance(ref, float) else f"{ref or '-':>8}"
        lines.append(f"  {d['config']:<26} {d['kv_dtype']:>8} {d['batch']:>5} "
                     f"{d['context']:>6} {d['num_splits']:>6} "
                     f"{d['ms']:8.3f} {d['bytes_read'] / 1e9:8.2f} {d['gb_per_s']:7.0f} "
                     f"{d['share_of_copy_bw'] * 100:7.0f}% {ref}"
                     + (f"  rotated {d['ms_rotated']:.3f} ms" if d.get("ms_rotated") else "")
                     + (f"  calibrated {d['ms_calibrated']:.3f} ms"
                        if d.get("ms_calibrated") else ""))
    lines += format_e2e(r.get("e2e"))
    lines += format_device(r.get("device_panel"))
    return "\n".join(lines)


def format_e2e(e: dict | None) -> list[str]:
    if not e:
        return []
    lines = ["", f"end to end on {e['device']} ({e['model']})"]
    for name, part_lines in E2E_PARTS.items():
        part = e.get(name) or {}
        if "error" in part:
            lines.append(f"  {name}: {part['error']}")
        elif part:
            lines += part_lines(part)
    return lines


def _families(fam: dict) -> list[str]:
    lines = [f"  tiny families, float32, against HF (all exact: {fam['all_exact']}):"]
    for k, v in fam.items():
        if isinstance(v, dict):
            lines.append(f"    {k:<12} " + ("; ".join(f"{b}: {_agree(x)}" for b, x in v.items())
                                          if "error" not in v else v["error"]))
    return lines


def _agreement(a: dict) -> list[str]:
    lines = [f"  greedy agreement with HF ({a['requests']} prompts x {a['prompt_tokens']} "
             f"tokens, {a['output_tokens']} out):"]
    for k, v in a.items():
        if not (k.startswith(("float", "bfloat")) and isinstance(v, dict)):
            continue
        if "vs_hf" in v:
            lines.append(f"    {k:<18} vs HF {_agree(v['vs_hf'])}; vs engine bf16 KV "
                         f"{_agree(v['vs_engine_bf16_kv'])} (rotation {v['kv_rotation']})")
        else:
            lines.append(f"    {k:<18} {_agree(v)}")
    return lines


def _preemption(p: dict) -> list[str]:
    return [f"  preemption: {p['preemptions']} preemptions in a pool of {p['num_kv_blocks']} "
            f"blocks; tokens equal to a roomy pool: {p['equal_to_roomy_pool']}; blocks free "
            f"after {p['blocks_free_after']}/{p['blocks_total']}"]


def _speculative(s: dict) -> list[str]:
    return [f"  speculative {k}: {_agree(v)} vs drafts off; acceptance length "
            f"{v['mean_acceptance_length']:.2f}, {v['seconds_plain']:.2f} s -> "
            f"{v['seconds_spec']:.2f} s" for k, v in s.items() if isinstance(v, dict)]


def _throughput(t: dict) -> list[str]:
    lines = []
    for row in t.get("rows", []):
        lines.append(f"  c={row['concurrency']:<3} HF static batch {row['hf_tok_s']:8.1f} tok/s")
        lines += [f"        engine, {k:<34} {v['tok_s']:8.1f} tok/s ({v['speedup_vs_hf']:.2f}x "
                  f"HF, {v['steps']} steps, {v['preemptions']} preemptions)"
                  for k, v in row.items() if isinstance(v, dict)]
    return lines


def _steps(st: dict) -> list[str]:
    lines = []
    for k, v in st.items():
        if not isinstance(v, dict):
            continue
        gpu = v.get("gpu_kernel_ms_per_step")
        lines.append(f"  decode step, {k:<11}: wall {v['step_wall_ms']:.2f} ms "
                     f"({v['tok_s']:.0f} tok/s)"
                     + (f", GPU kernels {gpu:.2f} ms, host overhead "
                        f"{v['host_overhead_ms']:.2f} ms, {v['kernels_per_step']:.0f} kernels"
                        if gpu is not None else ""))
    return lines


E2E_PARTS = {"families": _families, "agreement": _agreement, "preemption": _preemption,
             "speculative": _speculative, "throughput": _throughput, "steps": _steps}


def _agree(v: dict) -> str:
    return (f"{v['requests_equal'] * 100:.0f}% of requests equal, "
            f"{v['tokens_before_first_difference'] * 100:.0f}% of tokens before a difference")


def format_device(d: dict | None) -> list[str]:
    if not d:
        return []
    if "error" in d:
        return ["", f"device panel: {d['error']}"]
    lines = ["", "device panel (kvscope's NVML reads beside nvidia-smi's)", "  " + d["summary"]]
    for r in d["rows"]:
        ours = "-" if r["kvscope"] is None else f"{r['kvscope']:.1f}"
        ref = "-" if r["reference"] is None else f"{r['reference']:.1f}"
        diff = "" if r["diff"] is None else f"{r['diff'] * 100:6.1f}%"
        lines.append(f"  {r['name']:<24} {ours:>10} {ref:>10} {diff}"
                     + ("  FAIL" if not r["ok"] else ""))
    return lines


def format_with_verdict(r: dict) -> str:
    verdict = "all checks passed" if r["ok"] else "CHECKS FAILED"
    return f"{format_report(r)}\n\n{verdict} (seed {r['seed']}, {r['seconds']:.0f} s)"
