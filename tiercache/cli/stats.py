"""`tiercache stats`: a running `tiercache serve`'s tiers, counters and most read chunks, with its flags."""
from __future__ import annotations

import argparse
import json
import sys

from tiercache.cli.options import add_auth_token_flag, seconds
from tiercache.errors import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    st = sub.add_parser("stats", help="a running `tiercache serve`: its tiers, counters and most read chunks (JSON)")
    st.add_argument("--server", required=True, metavar="HOST:PORT", help="the server's gRPC address")
    add_auth_token_flag(st, "the server's auth token, when it requires one")
    st.add_argument("--timeout", type=seconds(0.001), default=5.0, help="seconds to wait for the answer")
    st.set_defaults(func=cmd_stats)


def cmd_stats(args: argparse.Namespace) -> int:
    import grpc

    from tiercache.config import is_host_port, read_token
    from tiercache.wire import tiercache_pb2 as pb
    from tiercache.wire.grpc_messages import AUTH_HEADER, method

    if not is_host_port(args.server):
        raise ConfigError("--server", args.server, "expected host:port")
    token = read_token(args.auth_token_file, "--auth-token-file") if args.auth_token_file else None
    with grpc.insecure_channel(args.server) as channel:
        call = channel.unary_unary(method("Stats"), lambda b: b, lambda b: b)
        try:
            raw = call(pb.StatsRequest().SerializeToString(), timeout=args.timeout,
                       metadata=((AUTH_HEADER, f"Bearer {token}"),) if token else ())
        except grpc.RpcError as err:
            print(f"tiercache: error: {args.server}: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    reply = pb.StatsReply.FromString(raw)
    print(json.dumps({
        "namespaces": reply.namespaces,
        "counters": dict(sorted(reply.counters.items())),
        "tiers": [{"name": t.name, "capacity_bytes": t.capacity_bytes, "used_bytes": t.used_bytes,
                   "chunks": t.chunks, "counters": dict(sorted(t.counters.items()))} for t in reply.tiers],
        "hot_chunks": [{"namespace": h.namespace.hex(), "key": h.key.hex(), "hits": h.hits} for h in reply.hot_chunks],
    }, indent=2))
    return 0
