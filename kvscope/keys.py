"""`kvscope keys`: make, show and exchange the CURVE keys of remote attach (no torch, no Qt)."""
from __future__ import annotations

import argparse
import sys

from kvscope.ipc import keys


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `keys` with its actions (init, show, allow, trust) on the launcher's subparsers."""
    p = sub.add_parser(
        "keys", help="CURVE keys for remote attach: init, show, allow, trust",
        description="CURVE keys for `kvscope serve` off loopback and `kvscope --attach`. On the "
                    "engine's machine: init, then allow each client's public client.key. On "
                    "the window's machine: init, then trust HOST with the engine's server.key.")
    folder = argparse.ArgumentParser(add_help=False)
    folder.add_argument("--keys", metavar="DIR",
                        help=f"key folder (default {keys.default_keys_dir()})")
    actions = p.add_subparsers(dest="action", required=True)
    init = actions.add_parser("init", parents=[folder],
                              help="write a server and a client key pair (secrets 0600)")
    init.add_argument("--force", action="store_true", help="replace existing keys")
    actions.add_parser("show", parents=[folder],
                       help="print the public keys and allowed clients")
    allow = actions.add_parser("allow", parents=[folder],
                               help="let the engine admit the client with this public key")
    allow.add_argument("public_key_file", metavar="PUBLIC_KEY_FILE",
                       help="the client's client.key (public; never the .key_secret)")
    allow.add_argument("--name", help="name it in allowed_clients/ (default: the file's name)")
    trust = actions.add_parser("trust", parents=[folder],
                               help="remember the engine on HOST by its public key")
    trust.add_argument("host", metavar="HOST", help="as in --attach tcp://HOST:PORT")
    trust.add_argument("public_key_file", metavar="SERVER_PUBLIC_KEY_FILE",
                       help="the engine's server.key (public)")
    return p


def run(args: argparse.Namespace) -> int:
    folder = keys.keys_dir(args.keys)
    try:
        if args.action == "init":
            for path in keys.init_keys(folder, force=args.force):
                print(f"wrote {path}")
            print("\n".join(keys.describe(folder)[1:3]))
        elif args.action == "show":
            print("\n".join(keys.describe(folder)))
        elif args.action == "allow":
            path = keys.allow_client(folder, args.public_key_file, args.name)
            print(f"allowed {keys.read_public(path).decode()} ({path}); a running engine "
                  f"admits it from its next connection")
        else:
            path = keys.trust_server(folder, args.host, args.public_key_file)
            print(f"the engine on {args.host} is {keys.read_public(path).decode()} ({path})")
    except (keys.KeyFileError, OSError) as exc:
        print(f"kvscope keys: error: {exc}", file=sys.stderr)
        return 2
    return 0
