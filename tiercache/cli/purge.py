"""`tiercache purge`: take KV out of a deployment (a tenant's, a namespace's, a prompt's, or what is older than
an age), with its flags."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tiercache.cli.options import add_auth_token_flag, seconds
from tiercache.errors import ConfigError

MAX_WAIT_S = 60


def register(sub: argparse._SubParsersAction) -> None:
    pu = sub.add_parser("purge", help="take KV out of a deployment: everything of a tenant or namespace, a "
                                      "prompt (and every chunk after it), or what is older than an age")
    what = pu.add_mutually_exclusive_group(required=True)
    what.add_argument("--everything", action="store_true", help="every chunk (of --namespace, when given)")
    what.add_argument("--older-than", type=seconds(0.0), metavar="SECONDS",
                      help="every chunk stored longer ago than this")
    what.add_argument("--prompt", help="a completion prompt's text (hashed as --replica does)")
    what.add_argument("--messages", metavar="FILE", help="a chat's messages, a JSON list (hashed as --replica does)")
    what.add_argument("--tokens", help="a prompt's token ids, comma separated")
    what.add_argument("--keys", help="chunk keys (hex), comma separated: each, and every chunk after it")
    _add_prompt_flags(pu)
    pu.add_argument("--namespace", action="append", default=[], metavar="HEX",
                    help="only this namespace (a storage digest, as `tiercache stats` and disk directories show)")
    pu.add_argument("--server", metavar="HOST:PORT", help="a `tiercache serve` (and the engines under it)")
    add_auth_token_flag(pu, "the server's auth token (a tenant with the purge right)")
    pu.add_argument("--tenant", default="", help="another tenant's chunks (an admin token's purge)")
    pu.add_argument("--wait", type=seconds(0.0), default=0.0, metavar="SECONDS",
                    help="longest wait for the engines under the server to apply it (default 5, at most 60)")
    pu.add_argument("--disk-path", action="append", default=[], help="a disk tier's directory (repeatable)")
    pu.add_argument("--redis", default="", metavar="URL", help="a Redis tier's URL (and the engines reading it)")
    pu.add_argument("--redis-cluster", action="store_true", help="--redis is a Redis Cluster")
    pu.set_defaults(func=cmd_purge)


def _add_prompt_flags(pu: argparse.ArgumentParser) -> None:
    """How a prompt is hashed into the chunk keys its engine stored it under."""
    pu.add_argument("--replica", help="for a prompt: how its engine names chunks — a running `tiercache api`'s URL "
                                      "or a replica descriptor file (a vLLM connector's `router_descriptor`)")
    pu.add_argument("--model", default="", help="the model the prompt was sent to (checked against --replica)")
    pu.add_argument("--tokenizer", default="", help="for a descriptor file without one: the model's directory")
    pu.add_argument("--chat-template", default="", choices=["", "tiercache", "hf"],
                    help="for a descriptor file without one: hf for a vLLM replica")
    pu.add_argument("--cache-salt", default="", help="the requests' cache_salt (the router's per-tenant salt)")
    pu.add_argument("--keep-first", type=int, default=0, metavar="TOKENS",
                    help="leading tokens of the prompt to keep (a shared system prompt): chunks wholly inside stay")


def cmd_purge(args: argparse.Namespace) -> int:
    from tiercache.config import read_token
    from tiercache.contracts.keys import NAMESPACE_DIGEST_BYTES
    from tiercache.contracts.purge import PurgeOrder
    from tiercache.purging import PurgeRefused, parse_hex_list, purge

    _check_targets(args)
    namespaces = parse_hex_list(",".join(args.namespace), "--namespace", NAMESPACE_DIGEST_BYTES) \
        if args.namespace else ()
    stored_before = time.time() - args.older_than if args.older_than is not None else None
    order = PurgeOrder(_roots(args), stored_before, args.everything, namespaces)
    token = read_token(args.auth_token_file, "--auth-token-file") if args.auth_token_file else None
    try:
        result = purge(order, args.server or "", token, args.tenant, args.wait, tuple(args.disk_path), args.redis,
                       args.redis_cluster)
    except PurgeRefused as err:
        print(f"tiercache: error: purge refused by {err}", file=sys.stderr)
        return 1
    print(json.dumps(result.as_dict(), indent=2))
    return 0


def _check_targets(args: argparse.Namespace) -> None:
    """Somewhere to purge, each place well formed, and a replica to hash a prompt with: before anything is
    hashed or sent."""
    from tiercache.config import is_host_port

    if not args.server and not args.disk_path and not args.redis:
        raise ConfigError("--server", "", "names nowhere to purge: give --server, --redis and/or --disk-path")
    if args.server and not is_host_port(args.server):
        raise ConfigError("--server", args.server, "expected host:port")
    for path in args.disk_path:
        if not Path(path).is_dir():
            raise ConfigError("--disk-path", path, "is not a directory")
    if args.wait > MAX_WAIT_S:
        raise ConfigError("--wait", args.wait, f"is at most {MAX_WAIT_S} seconds")
    if args.keep_first < 0:
        raise ConfigError("--keep-first", args.keep_first, "must be >= 0")
    if _names_a_prompt(args) and not args.replica:
        raise ConfigError("--replica", "", "a prompt is hashed as its engine does: give the replica it was sent to")


def _names_a_prompt(args: argparse.Namespace) -> bool:
    return bool(args.prompt is not None or args.messages or args.tokens)


def _roots(args: argparse.Namespace) -> tuple[bytes, ...]:
    """The chunk keys the purge starts from (each, and every chunk after it): ``--keys``, or a prompt's."""
    from tiercache.contracts.keys import HASH_BYTES
    from tiercache.purging import PromptSource, parse_hex_list, prompt_keys

    if args.keys:
        return parse_hex_list(args.keys, "--keys", HASH_BYTES)
    if not _names_a_prompt(args):
        return ()
    tokens = None
    if args.tokens:
        try:
            tokens = tuple(int(t) for t in args.tokens.split(",") if t.strip())
        except ValueError:
            raise ConfigError("--tokens", args.tokens, "must be integers, comma separated") from None
    return prompt_keys(PromptSource(args.replica, args.prompt, args.messages, tokens, args.model,
                                    args.tokenizer, args.chat_template, args.cache_salt, args.keep_first))
