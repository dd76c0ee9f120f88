"""`kvscope kv-accuracy`: its options and task defaults; the measurement is
engine/measure/kv_accuracy.py (chat prompts) and engine/measure/kv_long.py (long context).

    kvscope kv-accuracy [--dtypes ...] [--rotations ...] [--json]
    kvscope kv-accuracy --task passkey|document [--quick] [--save FILE | --no-save]
    kvscope kv-accuracy --trace TRACE | --prompts FILE
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvscope.engine.measure import kv_accuracy
from kvscope.engine.measure.timing import add_json_flag, print_result


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `kv-accuracy` and all its options on the launcher's subparsers action."""
    p = sub.add_parser("kv-accuracy", help="accuracy of each KV dtype against float32 KV",
                       description=kv_accuracy.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--task", choices=kv_accuracy.TASKS, default=None,
                   help="chat (the default), passkey, document; --trace/--prompts alone: "
                        "the user's prompts")
    p.add_argument("--dtypes", nargs="+", default=None, choices=kv_accuracy.DTYPES,
                   help=f"default: {' '.join(kv_accuracy.DTYPES)} (chat), "
                        "float32 bfloat16 int8 fp8 (long)")
    p.add_argument("--rotations", nargs="+", default=kv_accuracy.ROTATIONS,
                   choices=kv_accuracy.ROTATIONS,
                   help="K/V rotations to compare on int8/fp8 (wider dtypes run unrotated)")
    p.add_argument("--anchor-tokens", nargs="+", type=int, default=kv_accuracy.ANCHORS,
                   help="anchor-token counts to compare on int8/fp8 (0 = none)")
    p.add_argument("--prompts", type=Path, default=None,
                   help="a file of chat prompts, one a line (default for --task chat: "
                        "resources/kv_accuracy_prompts.txt)")
    p.add_argument("--num-prompts", type=int, default=None, help="only the first N prompts")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--text-tokens", type=int, default=512, help="perplexity text length cap")
    p.add_argument("--block-size", type=int, default=16)
    add_long_options(p)
    add_json_flag(p, "one JSON object keyed by row (dtype, or dtype+rotation); long tasks: "
                     "the grid")
    return p


def add_long_options(p: argparse.ArgumentParser) -> None:
    from kvscope.engine.measure import passkey_grid

    g = p.add_argument_group("long context (--task passkey|document, --trace, --prompts)")
    g.add_argument("--trace", type=Path, default=None,
                   help="a recorded session (kvscope or Mooncake-style trace): its prompts")
    g.add_argument("--lengths", nargs="+", type=int, default=None,
                   help="context lengths in tokens (passkey: 1024 2048 4096 8192, capped at "
                        "max_model_len; document: 1024 2048 4096 and the whole text)")
    g.add_argument("--depths", nargs="+", type=_depth, default=None,
                   help="where the key sits, percent (default 0 25 50 75 100)")
    g.add_argument("--document-tokens", type=int, default=None,
                   help="--task document: read only the document's first N tokens")
    g.add_argument("--seeds", type=int, default=passkey_grid.SEEDS,
                   help="keys per cell, each seeded")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--quick", action="store_true",
                   help=f"lengths {passkey_grid.QUICK_LENGTHS}, depths 0 50 100")
    g.add_argument("--kv-cache-mib", type=int, default=2048,
                   help="KV pool size (enough to keep a grid's shared filler cached)")
    g.add_argument("--max-num-batched-tokens", type=int, default=1024)
    g.add_argument("--save", type=Path, default=None,
                   help="where to save the run (default: the data folder's last-TASK.json)")
    g.add_argument("--no-save", action="store_true")


def _depth(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"depth {text} is not a percentage from 0 to 100")
    return value / 100


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The options of `kv-accuracy` parsed from argv (the command's own, without its name)."""
    parser = argparse.ArgumentParser(prog="kvscope")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return resolve_task(parser.parse_args(["kv-accuracy", *argv]))


def resolve_task(args: argparse.Namespace) -> argparse.Namespace:
    """The task and its defaults: --trace or --prompts without --task means the user's
    prompts; the chat table is the default otherwise."""
    from kvscope.engine.measure import passkey_grid
    from kvscope.engine.measure.kv_long import DOCUMENT_LENGTHS

    if args.task is None:
        args.task = "prompts" if args.trace is not None or args.prompts is not None else "chat"
    if args.task == "chat" and args.prompts is None:
        args.prompts = kv_accuracy.PROMPTS_FILE
    if args.task == "chat" and args.dtypes is None:
        args.dtypes = kv_accuracy.DTYPES
    if args.task == "passkey":
        quick = args.quick
        args.lengths = args.lengths or (passkey_grid.QUICK_LENGTHS if quick
                                        else passkey_grid.LENGTHS)
        args.depths = args.depths or (passkey_grid.QUICK_DEPTHS if quick
                                      else passkey_grid.DEPTHS)
    if args.task == "document":
        args.lengths = args.lengths or DOCUMENT_LENGTHS
    if args.seeds < 1:
        raise SystemExit("kvscope kv-accuracy: --seeds must be at least 1")
    return args


def run(args: argparse.Namespace) -> int:
    """`kvscope kv-accuracy`: measure every row, print the table or the JSON object; a long
    task prints its grid and saves it for the window."""
    args = resolve_task(args)  # the launcher parses without it
    if args.task != "chat":
        return kv_accuracy.run_long_task(args)
    print_result(kv_accuracy.measure_rows(args), kv_accuracy.format_table, args.json)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m kvscope.engine.cli.kv_accuracy`: the `kv-accuracy` command alone."""
    return run(parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
