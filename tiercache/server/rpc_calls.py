"""How `tiercache serve` handles a call on grpc.aio, whatever the call (server).

A refusal is raised as `Rejected` and answered with its status; the watchdogs (`tiercache.server.limits.StreamWatch`)
end a call through `TaskCall`; a call's one request is read under its slot with `SlotRequest`; gRPC's reads and
writes are awaited through `uncancelled`, so a cancelled handler never loses the memory an operation holds; and
`forget_frames` keeps an exception that ends a call from holding the handler's frames.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import grpc


def forget_frames(err: BaseException) -> None:
    """Drop the tracebacks of ``err`` and of the exceptions it was raised from or during."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        err.__traceback__ = None
        err = err.__cause__ or err.__context__


class Rejected(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class TaskCall:
    """An asyncio handler's call as the watchdogs (`StreamWatch`) see it: `abort`, from any thread, cancels
    the handler's task, and `ended_as_rejection` turns that cancellation into the status it was ended with."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._task = asyncio.current_task()
        self._ended: tuple[grpc.StatusCode, str] | None = None

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self._ended = (code, details)
        self._loop.call_soon_threadsafe(self._task.cancel)

    @contextlib.contextmanager
    def ended_as_rejection(self):
        try:
            yield
        except asyncio.CancelledError:
            if self._ended is None:          # cancelled by gRPC: the client left, or the server stops
                raise
            self._task.uncancel()
            raise Rejected(*self._ended) from None


class SlotRequest:
    """Reads a call's one request under its slot, telling the watchdog while the handler waits for it."""

    def __init__(self, context: grpc.aio.ServicerContext, waiting, moved) -> None:
        self._context = context
        self._waiting = waiting
        self._moved = moved

    async def read(self) -> bytes:
        self._waiting()
        message = await uncancelled(self._context.read())
        self._moved()
        if message is grpc.aio.EOF:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "the call ended before its request came")
        return message


def identity(data: bytes) -> bytes:
    return data


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()             # an outcome nobody awaits any more is not an error to report


async def uncancelled(operation) -> Any:
    """Await one of gRPC's reads or writes so that cancelling the handler does not cancel the operation.

    grpc.aio frees what an operation holds in C — a received message's buffer, a sent one's — only when its
    awaiter sees it complete; an awaiter cancelled first drops it, and that memory is never given back
    (grpc/grpc#43360). Calls are cancelled all the time here (a client's deadline, a slot taken back), and
    each could lose a message of up to ``max_message`` bytes, without bound under a hostile tenant's rounds
    of maximal calls. Shielded, the operation runs to its end — the call's end completes it — and its
    awaiter frees it, while the handler is cancelled at once."""
    task = asyncio.ensure_future(operation)
    task.add_done_callback(_retrieve)
    return await asyncio.shield(task)
