"""How fast a replica loads KV from each of its tiers, from its own copies: what a router weighs a cached
prefix by.

Replica side, from its rank 0's transfer statistics (`LinkStats` routes: bytes, busy seconds and blocks per
"src→dst"). A chunk in L1 reaches the engine's pool in one copy (``L1 → device``); one in a lower tier is
promoted to L1 first, so its rate per token is the two copies' times added. A route reported only once it
has moved `MIN_BLOCKS` blocks, so a first small load does not set the rate.
"""
from __future__ import annotations

from tiercache.contracts.plan import DEVICE

MIN_BLOCKS = 32


def load_tokens_per_s(transfers: dict[str, dict], l1: str, lower: dict[str, str], block_size: int,
                      l1_medium: str = "CPU") -> dict[str, float]:
    """Tokens per second into the pool per medium (``l1_medium`` for L1; ``lower``: tier name → its medium),
    for the media it has loaded enough from to tell (`MIN_BLOCKS`)."""
    routes: dict[str, list[float]] = {}
    for link in transfers.values():
        for name, route in link.get("routes", {}).items():
            total = routes.setdefault(name, [0.0, 0.0])
            total[0] += route.get("seconds", 0.0)
            total[1] += route.get("blocks", 0)

    def seconds_per_block(name: str) -> float | None:
        seconds, blocks = routes.get(name, (0.0, 0))
        return seconds / blocks if blocks >= MIN_BLOCKS and seconds > 0 else None

    into_pool = seconds_per_block(f"{l1}→{DEVICE}")
    if into_pool is None:
        return {}
    rates = {l1_medium: round(block_size / into_pool, 1)}
    for tier, medium in lower.items():
        promote = seconds_per_block(f"{tier}→{l1}")
        if promote is not None:
            rates[medium] = round(block_size / (promote + into_pool), 1)
    return rates
