"""Purges and expiries on the tiers this engine indexes: what a purge order selects, and what passed retention,
leaves every index here; both are written to the audit trail.

Scheduler side, indexes only: the lower tiers' bytes go with the next background step's deletes. A chunk
being read or written goes when its transfer ends, and is not served meanwhile.
"""
from __future__ import annotations

from collections.abc import Sequence

from tiercache.audit import AuditTrail
from tiercache.contracts.purge import PurgeOrder, PurgeReport, order_selectors
from tiercache.hot_chunks import HotChunks
from tiercache.index.indexed_tier import IndexedTier
from tiercache.index.tier_index import TierIndex
from tiercache.manager.jobs import JobBook
from tiercache.tiers.base import LowerIndex


class Purges:
    """Applies purge orders (this engine's, and those the shared tiers' stores pass on) and retention."""

    def __init__(self, tiers: Sequence[TierIndex], lower: Sequence[LowerIndex], jobs: JobBook, hot: HotChunks,
                 audit: AuditTrail) -> None:
        self.tiers = tiers
        self.lower = lower
        self.jobs = jobs
        self.hot = hot
        self.audit = audit

    def purge(self, order: PurgeOrder) -> PurgeReport:
        """Take what ``order`` selects out of L1 and every tier with an index here (a chain is followed across
        them: it may run from L1 into the disk)."""
        report = PurgeReport()
        tiers = [t for t in self.tiers if isinstance(t, IndexedTier)]    # a remote tier's store purges itself
        chosen = order.selector([pair for t in tiers for pair in t.links()] if order.roots else ())
        for tier in tiers:
            keys, nbytes = tier.purge(chosen)
            report.add(tier.name, len(keys), nbytes)
            self.hot.forget(keys)
        self.jobs.mark_purged(chosen)
        return report

    def apply_passed_on(self) -> None:
        """Apply the purges the shared tiers' stores made (they reach this engine's own tiers this way), before
        a step looks anything up or stores anything."""
        for tier in self.lower:
            orders = tier.take_purges()
            if not orders:
                continue
            for order in orders:
                report = self.purge(order)
                self.audit.record("purge_applied", f"applied a purge from {tier.name}: {report.chunks} chunks, "
                                                   f"{report.nbytes} bytes", chunks=report.chunks,
                                  nbytes=report.nbytes, source=tier.name, selectors=order_selectors(order),
                                  tiers=report.tiers)
            tier.purges_applied()

    def expire(self) -> None:
        """Take what passed retention out of every tier: never served again, its room given back."""
        for tier in self.tiers:
            gone = tier.expire()
            if gone:
                self.audit.record("expired", f"tier {tier.name}: {len(gone)} chunks past retention removed",
                                  chunks=len(gone), tier=tier.name)
