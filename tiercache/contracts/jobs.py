"""How both sides cut work into jobs and keep track of whose jobs are still running.

Plain helpers over plans' chunks and `JobId`s, shared by the scheduler side
(`tiercache.manager`, `tiercache.connector.scheduler`) and the worker side
(`tiercache.connector.worker`).
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar

from tiercache.contracts.plan import JobId

T = TypeVar("T")


def split_jobs(items: Sequence[T], workers: int) -> list[list[T]]:
    """``items`` dealt into one part per transfer worker (item ``i`` to part ``i % n``), so that the I/O of one
    part overlaps the checksums and syncs of another; never an empty part (no items: no parts)."""
    n = min(workers, len(items))
    return [list(items[i::n]) for i in range(n)] if n > 0 else []


class JobsByOwner:
    """The jobs still running for each owner (a request, by id): an owner is here while it has at least one."""

    def __init__(self) -> None:
        self._jobs: dict[str, set[JobId]] = {}

    def add(self, owner: str, job_id: JobId) -> None:
        self._jobs.setdefault(owner, set()).add(job_id)

    def finish(self, owner: str, job_id: JobId) -> None:
        """Job ``job_id`` of ``owner`` ended; the owner leaves with its last job."""
        jobs = self._jobs.get(owner)
        if jobs is not None:
            jobs.discard(job_id)
            if not jobs:
                del self._jobs[owner]

    def of(self, owner: str) -> frozenset[JobId]:
        """The jobs of ``owner`` still running (empty: none)."""
        return frozenset(self._jobs.get(owner, ()))

    def forget(self, owner: str) -> None:
        """Stop tracking ``owner``'s jobs (its caller has waited for them)."""
        self._jobs.pop(owner, None)

    def __contains__(self, owner: object) -> bool:
        return owner in self._jobs

    def __iter__(self) -> Iterator[str]:
        return iter(self._jobs)

    def __len__(self) -> int:
        return len(self._jobs)
