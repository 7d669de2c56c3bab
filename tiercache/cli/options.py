"""What the command line's flags accept: argparse types that turn text into values (a wrong one is one line
naming the flag), and the flags several commands share, added by one helper each.

Sizes go through the config tree's own parser (`tiercache.config.parse_size`), and a flag that sets a config
field is checked by the config tree itself (`config_check`), so a flag and its field refuse the same values.
"""
from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from tiercache.config import TierCacheConfig, parse_size
from tiercache.errors import ConfigError

TIERS = frozenset({"cpu", "disk", "redis", "grpc"})
BENCH_TIERS = TIERS | {"grpc-stream", "grpc-shm"}
SHAPE_NAMES = ["llama-8b", "small"]


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def port(text: str) -> int:
    """A TCP port: 0..65535 (0: any free port)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0..65535, got {value}")
    return value


def finite(text: str, lowest: float = 0.0) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < lowest:
        raise argparse.ArgumentTypeError(f"expected a finite number >= {lowest:g}, got {text!r}")
    return value


def seconds(lowest: float) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds, at least ``lowest``."""
    return lambda text: finite(text, lowest)


def size(text: str) -> int:
    """A size as the config tree reads one (``8GiB``, ``512MB``, a number of bytes)."""
    try:
        return parse_size(text, "size")
    except ConfigError as err:
        raise argparse.ArgumentTypeError(f"{err.reason}, got {text!r}") from None


def size_list(flag: str, example: str) -> Callable[[str], list[int]]:
    """An argparse type: comma-separated positive sizes (``1M``, ``64GiB``), named ``flag`` in errors."""
    def parse(text: str) -> list[int]:
        try:
            values = [parse_size(v.strip(), flag) for v in text.split(",") if v.strip()]
        except ConfigError as err:
            raise argparse.ArgumentTypeError(f"{err.reason}, got {text!r}") from None
        if not values or any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"expected positive values such as {example}, got {text!r}")
        return values
    return parse


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _split(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def names(text: str, known: list[str], what: str) -> list[str]:
    """A comma-separated list of names, each one of ``known`` (a flag's type: a wrong one is one line)."""
    listed = _split(text)
    unknown = [n for n in listed if n not in known]
    if not listed or unknown:
        raise argparse.ArgumentTypeError(f"unknown {what} {unknown or text!r}; known: {', '.join(known)}")
    return listed


def tier_list(text: str, known: frozenset[str] = TIERS) -> list[str]:
    """Tiers below L0 by name (``cpu,disk``), or ``none``."""
    listed = _split(text)
    if listed == ["none"]:
        return []
    unknown = [n for n in listed if n not in known]
    if not listed or unknown:
        raise argparse.ArgumentTypeError(f"unknown tier(s) {unknown or text!r}; known: {', '.join(sorted(known))}")
    return listed


def bench_tier_list(text: str) -> list[str]:
    return tier_list(text, BENCH_TIERS)


def codec_list(text: str) -> list[str]:
    from tiercache.codecs import codecs
    return names(text, codecs.names(), "codec")


def tier_format_list(text: str) -> list[str]:
    """Codecs, each optionally sealed (``NAME+aes``): the formats `bench tiers` runs in turn."""
    from tiercache.bench.formats import split_variant
    listed = _split(text)
    codec_list(",".join(split_variant(n)[0] for n in listed) or text)
    return listed


def routing_list(text: str) -> list[str]:
    from tiercache.fleet.routing import routing_policies
    return names(text, routing_policies.names(), "routing policy")


def preemption_list(text: str) -> list[str]:
    from tiercache.engine.preemption import preemption_policies
    return names(text, preemption_policies.names(), "preemption mode")


def pressure_list(text: str) -> list[str]:
    from tiercache.bench.preemption import PRESSURE_WORKLOADS
    return names(text, list(PRESSURE_WORKLOADS), "pressure workload")


def policy_list(text: str) -> list[str]:
    """Eviction policies, each optionally ``+ADMISSION`` (what the tier admits: ``lfu-da+second-sighting``) and,
    for a replay of L1 over L2, ``L1/L2`` (each tier's own: ``lfu-da/reuse-model``)."""
    from tiercache.policies import admission_policies, eviction_policies
    listed = _split(text)
    evictions = [e for n in listed for e in n.partition("+")[0].split("/")]
    names(",".join(evictions) or text, eviction_policies.names(), "policy")
    admitted = [n.partition("+")[2] for n in listed if "+" in n]
    if admitted:
        names(",".join(admitted), admission_policies.names(), "admission policy")
    return listed


def config_check(flag: str, section: str, field: str, value: object) -> None:
    """Check a flag's value as the config field it stands for (``section.field``) checks it, and report a
    refusal under the flag's name."""
    try:
        TierCacheConfig().replace(**{section: {field: value}})
    except ConfigError as err:
        raise ConfigError(flag, value, err.reason) from None


# ---------------------------------------------------------------------------------------- flags commands share

def add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="YAML or TOML config file")
    p.add_argument("--set", metavar="SECTION.FIELD=VALUE", action="append", default=[],
                   help="override one config field (repeatable)")


def add_report_flags(p: argparse.ArgumentParser, files: str | None, json_help: str | None = None,
                     quiet_help: str | None = None) -> None:
    """``--out DIR`` (writing ``files``), ``--json PATH`` and ``--quiet``, in that order."""
    if files:
        p.add_argument("--out", metavar="DIR", help=f"write {files} here")
    p.add_argument("--json", metavar="PATH", help=json_help)
    p.add_argument("--quiet", action="store_true", help=quiet_help)


def add_shape_flag(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--shape", choices=SHAPE_NAMES, default="llama-8b", help=help)


def add_chunk_tokens_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chunk-tokens", type=positive, default=256, help="tokens per chunk (multiple of 16)")


def add_reps_flag(p: argparse.ArgumentParser, default: int, help: str = "repetitions (medians are reported)"
                  ) -> None:
    p.add_argument("--reps", type=positive, default=default, help=help)


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """The reference engine's weights and tokenizer (`generate`, `api`)."""
    p.add_argument("--model-path", help="local Hugging Face Llama directory (default: seeded weights)")
    p.add_argument("--tokenizer", help="tokenizer.json or its directory (default: bytes)")


def add_tier_flags(p: argparse.ArgumentParser, default: list[str], tiers_help: str, disk_help: str,
                   redis_help: str = "L3 Redis server (default: redis.url)",
                   grpc_help: str = "L3 `tiercache serve` host:port (default: grpc.address)") -> None:
    """``--tiers`` below the reference engine's L0 and where each lives (`demo`, `generate`, `api`)."""
    p.add_argument("--tiers", type=tier_list, default=default, help=tiers_help)
    p.add_argument("--disk-path", help=disk_help)
    p.add_argument("--redis-url", help=redis_help)
    p.add_argument("--grpc-address", help=grpc_help)


def add_block_size_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block-size", type=positive, default=16)


def add_listen_flags(p: argparse.ArgumentParser, default_port: int) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=port, default=default_port, help="port (0: any free port, printed at start)")


def add_auth_token_flag(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--auth-token-file", default="", help=help)
