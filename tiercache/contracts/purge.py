"""Purges: what to take out of every tier, as plain data (`PurgeOrder`), and what came out (`PurgeReport`).

Runs anywhere. A purge names what goes by one of three selectors, each of
which can be combined with ``namespaces`` (the storage digests it is limited
to; empty: every namespace of its scope, a tenant or an engine):

- ``roots``: chunk keys of a prompt. Every chunk whose chain passes through
  one of them goes — the root itself and every chunk after it in any request
  (a later chunk's KV encodes the earlier tokens too). A chunk's parent is in
  its header and in every index that holds it, so a store finds the chains
  without the engine that wrote them (`chain_closure`).
- ``stored_before``: every chunk stored before this wall-clock time (by age).
- ``everything``: all of the scope.

``issued_at`` keeps a late application exact: an engine that learns of a
purge after it was made (it polls for them, or was down) takes only chunks
stored up to then — later ones are new data. A chunk being written has no
store time yet (0) and is always taken.

A chunk whose parent is held by no tier any more cannot be tied to a root;
it can never be served either (lookups take leading runs from a request's
first chunk), and purges by namespace, tenant or age take it.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tiercache.contracts.keys import HASH_BYTES, NAMESPACE_DIGEST_BYTES, BlockHash

POLL_INTERVAL_S = 0.5     # how often a client tier asks its store for purges to apply to its engine's tiers
WATCHER_TTL_S = 10.0      # an engine that has not polled for this long is not waited for
DEFAULT_WAIT_S = 5.0      # how long a purge waits for the engines to apply it, unless told


@dataclass(frozen=True, slots=True)
class PurgeOrder:
    roots: tuple[BlockHash, ...] = ()
    stored_before: float | None = None     # wall-clock seconds (time.time())
    everything: bool = False
    namespaces: tuple[bytes, ...] = ()
    issued_at: float | None = None         # when it was made: a chunk stored later is new data, never taken

    def __post_init__(self) -> None:
        if not (self.roots or self.stored_before is not None or self.everything):
            raise ValueError("a purge names what goes: prompt keys, an age, or everything")
        if any(len(k) != HASH_BYTES for k in self.roots):
            raise ValueError(f"a purge's prompt keys are {HASH_BYTES} bytes each")
        if any(len(n) != NAMESPACE_DIGEST_BYTES for n in self.namespaces):
            raise ValueError(f"a purge's namespaces are {NAMESPACE_DIGEST_BYTES}-byte digests")

    def selector(self, links: Iterable[tuple[bytes, bytes | None]] = ()):
        """``chosen(key, stored_at) -> bool`` for the chunks of one scope; ``links`` are (key, parent) pairs of
        every chunk the scope holds (its tiers together: a chain may run from one tier into another)."""
        closure = chain_closure(self.roots, links) if self.roots else frozenset()
        everything, before = self.everything, self.stored_before
        until = float("inf") if self.issued_at is None else self.issued_at

        def chosen(key: bytes, stored_at: float) -> bool:
            return stored_at <= until and (everything or key in closure
                                           or (before is not None and stored_at < before))
        return chosen


def order_selectors(order: PurgeOrder) -> dict[str, object]:
    """What an audit line says of a purge: its selectors (the first root's key, not the prompt)."""
    out: dict[str, object] = {}
    if order.roots:
        out["roots"] = len(order.roots)
        out["first_root"] = order.roots[0].hex()[:16]
    if order.stored_before is not None:
        out["stored_before"] = order.stored_before
    if order.everything:
        out["everything"] = True
    if order.namespaces:
        out["namespaces"] = [n.hex() for n in order.namespaces]
    return out


def repeat_passes(one_pass: Callable[[], tuple[int, int]], passes: int = 4) -> tuple[int, int]:
    """Run a store's purge pass (returning what it took: chunks, bytes) until one takes nothing, at most
    ``passes`` times: what a writer already on its way put down meanwhile goes too. The sums."""
    removed = nbytes = 0
    for _ in range(passes):
        chunks, size = one_pass()
        removed += chunks
        nbytes += size
        if not chunks:
            break
    return removed, nbytes


def chain_closure(roots: Iterable[bytes], links: Iterable[tuple[bytes, bytes | None]]) -> frozenset[bytes]:
    """``roots`` and every key whose chain of parents (over ``links``: (key, parent) pairs) reaches one."""
    children: defaultdict[bytes, list[bytes]] = defaultdict(list)
    for key, parent in links:
        if parent is not None:
            children[parent].append(key)
    found = set(roots)
    todo = list(found)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return frozenset(found)


@dataclass(slots=True)
class PurgeReport:
    """Per tier: (chunks, bytes) a purge took out (a pinned chunk counts: unreadable at once, gone when its
    last reader lets go)."""
    tiers: dict[str, list[int]] = field(default_factory=dict)

    def add(self, tier: str, chunks: int, nbytes: int) -> None:
        got = self.tiers.setdefault(tier, [0, 0])
        got[0] += chunks
        got[1] += nbytes

    @property
    def chunks(self) -> int:
        return sum(c for c, _ in self.tiers.values())

    @property
    def nbytes(self) -> int:
        return sum(b for _, b in self.tiers.values())
