"""`tiercache route`: the router in front of a fleet of replicas, with its flags."""
from __future__ import annotations

import argparse
import importlib.util

from tiercache.cli.common import check_listen
from tiercache.cli.options import add_listen_flags, positive_float
from tiercache.errors import ConfigError, TierCacheError


def register(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("route", help="route OpenAI API requests to the replica where their prefix is cheapest "
                                     "(expected time to first token)")
    r.add_argument("--replica", action="append", default=[], metavar="URL",
                   help="a replica's base URL, e.g. http://127.0.0.1:8001 (repeat; more can join at run time "
                        "through /admin/replicas)")
    r.add_argument("--replicas", metavar="FILE", help="replicas from a file (YAML or JSON), each with its "
                                                      "descriptor when it serves none itself (vllm serve): see "
                                                      "the README's Fleet section")
    add_listen_flags(r, 8080)
    r.add_argument("--policy", default="expected-ttft",
                   help="expected-ttft (default), prefix-affinity, least-loaded or round-robin")
    r.add_argument("--tenants", metavar="FILE", help="API keys → tenants (YAML or JSON); without it one "
                                                     "anonymous tenant, no key asked")
    r.add_argument("--health-interval", type=positive_float, default=2.0,
                   help="seconds between health checks; a replica silent for one leaves the pool")
    r.add_argument("--prefill-tokens-per-s", type=positive_float, default=20_000.0,
                   help="a replica's prefill rate until the router has measured it, for a replica whose "
                        "descriptor carries no profile of its own (tiercache api measures one before serving)")
    r.add_argument("--admin-key", help="key of /admin/replicas (without one those routes are off)")
    r.add_argument("--sticky-sessions", action="store_true",
                   help="a request with a session (vLLM's session_id field or X-Session-ID header) goes first to "
                        "the replica that served its session last, unless it is down or twice as slow as the best")
    r.set_defaults(func=cmd_route)


def cmd_route(args: argparse.Namespace) -> int:
    for module in ("aiohttp", "zmq", "msgspec", "prometheus_client"):
        if importlib.util.find_spec(module) is None:
            raise TierCacheError(f"tiercache route needs {module}, which is not installed: "
                                 f"pip install 'tiercache[fleet]'")
    from tiercache.fleet.router import RouterConfig, serve
    from tiercache.fleet.routing import routing_policies
    from tiercache.fleet.tenants import Tenants

    if args.policy not in routing_policies:
        raise ConfigError("--policy", args.policy, f"known: {', '.join(routing_policies.names())}")
    entries = _replicas(args)
    tenants = Tenants.load(args.tenants) if args.tenants else Tenants()
    config = RouterConfig(policy=args.policy, health_interval_s=args.health_interval,
                          prefill_tokens_per_s=args.prefill_tokens_per_s, admin_key=args.admin_key or "",
                          sticky_sessions=args.sticky_sessions)
    check_listen(args.host, args.port, "--port")
    serve(entries, args.host, args.port, config, tenants,
          ready=lambda port: print(f"tiercache route: {len(entries)} replicas behind http://{args.host}:{port}/v1 "
                                   f"({args.policy})", flush=True))
    return 0


def _replicas(args: argparse.Namespace) -> list:
    """The replicas of ``--replica`` and ``--replicas``, each named once."""
    from tiercache.fleet.replicas import ReplicaEntry, check_url, load_replicas

    entries = [ReplicaEntry(check_url(u, "--replica")) for u in args.replica]
    entries += load_replicas(args.replicas) if args.replicas else []
    urls = [e.url for e in entries]
    if len(set(urls)) != len(urls):
        raise ConfigError("--replica", ",".join(urls), "names a replica twice")
    return entries
