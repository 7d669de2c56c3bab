"""A transport's codec work, overlapped with its I/O (worker side).

A quantizing codec (`tiercache.kv_quant`) costs a chunk about as long as a
fast link takes to move it; done in line, a writer's encode and its send add
up, and so do a reader's receive and its decode. `CodecPipeline` moves that
work onto the worker's codec threads (`CodecThreads`), beside the I/O:

- `encoded` hands a writer each chunk's stored form in order, the next
  chunks (as many as there are codec threads) already being encoded while it
  sends this one. Each chunk's encode is cut into a part per codec thread
  (`tiercache.codecs.EncodeJob`), so the threads finish one chunk together and
  then the next: the link waits for the first chunk of a batch about half as
  long as for two whole-chunk encodes side by side on these cores;
- `reads` opens one batch of reads: each encoded payload lands in one of a
  few buffers in turn and is verified and decoded into its L1 slot on a codec
  thread while the reader takes the next ones in. The batch waits for every
  decode before it closes, so nothing writes into a slot after its job has
  reported, and a payload that fails its checks there is a corrupt chunk.

torch's ops and file and socket I/O release the GIL, so the two run side by
side. A raw chunk has no codec work: it is checksummed as it is sent and read
straight into place, as before. A chunk the codec refuses (inf or nan KV) is
reported as refused and fails alone; the rest of its batch still moves.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from tiercache.codecs import Buffer, Codec, EncodeJob
from tiercache.contracts.keys import BlockHash
from tiercache.contracts.plan import Failure
from tiercache.errors import ChunkFormatError, NonFiniteKVError
from tiercache.log_limits import ThrottledLog
from tiercache.machine import keep_torch_to_one_core
from tiercache.wire.chunk_format import ChunkFormat, ChunkKeys, ChunkMeta, ParsedHeader, verify_payload_into

log = logging.getLogger(__name__)
T = TypeVar("T")


class CodecThreads:
    """One worker's codec threads (``transfer.codec_threads``), shared by its transports and transfer
    threads, each keeping its torch ops to one core (`keep_torch_to_one_core`): the I/O they overlap with
    needs a core too, and a torch op split across every core waits for its slowest part — the one sharing a
    core with the I/O. Beside a thread writing files, an encode kept to one core runs faster than one on
    torch's whole team (`benchmarks/codec_beside_io.py` compares them); two such threads work side by side,
    and the engine's threads keep every core."""

    def __init__(self, threads: int, name: str = "tiercache-codec") -> None:
        if threads < 1:
            raise ValueError(f"codec threads must be >= 1, got {threads}")
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=name, initializer=keep_torch_to_one_core)

    def submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@dataclass(frozen=True, slots=True)
class Encoded:
    """One chunk's stored form, or why the codec refused it (``refused``: header and payload empty)."""
    meta: ChunkMeta
    header: bytes
    payload: memoryview
    refused: str | None = None
    sealed_in: bytearray | None = None    # the buffer an encrypted payload lies in (given back once written)


class SealBuffers:
    """Buffers that encrypted payloads are written into, made once and used again: a fresh buffer per chunk
    costs more in first-touch page faults than AES-GCM does. A buffer is given back when the writer asks
    for the chunk after its own (every writer is done with a chunk's payload by then); a few are kept."""

    def __init__(self, keep: int) -> None:
        self._max_free = keep            # buffers kept for reuse at most
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bytearray:
        with self._lock:
            for i, buf in enumerate(self._free):
                if len(buf) >= nbytes:
                    return self._free.pop(i)
        return bytearray(nbytes)

    def give(self, buf: bytearray | None) -> None:
        if buf is not None:
            with self._lock:
                if len(self._free) < self._max_free:
                    self._free.append(buf)


class ReadBatch:
    """One batch of reads on one thread (`CodecPipeline.reads`): where encoded payloads land, and their
    decodes in flight. ``failed`` holds, once the batch is closed, the keys whose payload failed its checks."""

    def __init__(self, pool: CodecThreads | None, buffers: list[bytearray]) -> None:
        self._pool = pool
        self._buffers = buffers
        self._busy: list[Future[None] | None] = [None] * len(buffers)
        self._turn = 0
        self._pending: list[tuple[BlockHash, Future[None]]] = []
        self.failed: dict[BlockHash, ChunkFormatError] = {}

    def landing(self, nbytes: int) -> memoryview:
        """A buffer of ``nbytes`` for the next payload: the one whose decode finished longest ago (waited for)."""
        i = self._turn
        self._turn = (i + 1) % len(self._buffers)
        busy = self._busy[i]
        if busy is not None:
            busy.exception()          # wait; its outcome is collected at close
            self._busy[i] = None
        if len(self._buffers[i]) < nbytes:
            self._buffers[i] = bytearray(nbytes)
        return memoryview(self._buffers[i])[:nbytes]

    def decode(self, key: BlockHash, parsed: ParsedHeader, payload: memoryview, out: memoryview,
               signer: ChunkKeys | None) -> None:
        """Verify ``payload`` (the buffer `landing` just gave) and decode it into ``out``: on the codec thread,
        or here and now when the transport has none (a failure raises `ChunkFormatError`)."""
        if self._pool is None:
            verify_payload_into(parsed, payload, out, signer)
            return
        job = self._pool.submit(verify_payload_into, parsed, payload, out, signer)
        self._busy[(self._turn - 1) % len(self._buffers)] = job
        self._pending.append((key, job))

    def close(self) -> None:
        """Wait for every decode; a payload that failed its checks goes into ``failed`` (anything else
        raised there is a bug, and raises here)."""
        pending, self._pending = self._pending, []
        error: BaseException | None = None
        for key, job in pending:
            err = job.exception()
            if isinstance(err, ChunkFormatError):
                self.failed[key] = err
            elif err is not None and error is None:
                error = err
        self._busy = [None] * len(self._buffers)
        if error is not None:
            raise error

    def settled(self, items: Sequence[tuple[BlockHash, memoryview]], out: Sequence[int | Failure],
                corrupt: Callable[[BlockHash, ChunkFormatError], Failure]) -> list[int | Failure]:
        """A closed batch's results per item: a chunk whose payload failed its checks on a codec thread is
        what ``corrupt`` (the transport's log line) makes of it; the others as they were read."""
        return [corrupt(key, self.failed[key]) if key in self.failed and not isinstance(got, Failure) else got
                for (key, _), got in zip(items, out)]

    def __enter__(self) -> "ReadBatch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CodecPipeline:
    """One transport's codec work, on its worker's codec threads; in line on the transfer thread when there
    are none, or the format is raw (no codec work to move)."""

    def __init__(self, fmt: ChunkFormat, threads: CodecThreads | None, name: str) -> None:
        self.fmt = fmt
        self.name = name
        # raw and not sealed: no codec work to move off the transfer thread
        self._pool = None if threads is None or (fmt.codec.code == fmt.raw.code and not fmt.sealed) else threads
        self._landings = threading.local()    # each transfer thread's landing buffers, kept across batches
        # as many as can be in flight: one being written, the next, one sealing on each codec thread
        self._seal_buffers = SealBuffers(keep=self._pool.threads + 2 if self._pool is not None else 2)
        self._warn = ThrottledLog(log)        # refused chunks: one line per 10 s, with a count

    def encoded(self, items: Sequence[tuple[ChunkMeta, Buffer]],
                refused: list[tuple[BlockHash, Failure]]) -> Iterator[Encoded]:
        """Each item's stored form, in order; the next items (one per codec thread, each cut into a part per
        thread) are encoded while the caller writes this one. A chunk the codec refuses is logged and put in
        ``refused`` as it comes, and still yielded (flagged) for a writer that declared a count to withdraw;
        the others skip it. An abandoned iteration leaves the encodes ahead running, into buffers of their own."""
        for chunk in self._ahead(items):
            if chunk.refused is not None:
                self._warn.warning("refused", "%s tier: chunk %s… not stored: %s", self.name,
                                   chunk.meta.key.hex()[:16], chunk.refused)
                refused.append((chunk.meta.key, Failure.IO))
            yield chunk

    def _ahead(self, items: Sequence[tuple[ChunkMeta, Buffer]]) -> Iterator[Encoded]:
        if self._pool is None:
            for meta, raw in items:
                codec, job = self.fmt.encode_job(meta, raw, 1)
                chunk = self._sealed(meta, codec, job.run)
                yield chunk
                self._seal_buffers.give(chunk.sealed_in)      # asked for the next: this one is written
            return
        ahead = self._pool.threads
        started = deque(self._start(*item) for item in items[:ahead])
        for i in range(len(items)):
            chunk = started.popleft().result()
            if i + ahead < len(items):
                started.append(self._start(*items[i + ahead]))
            yield chunk
            self._seal_buffers.give(chunk.sealed_in)

    def _start(self, meta: ChunkMeta, raw: Buffer) -> Future[Encoded]:
        """Queue a chunk's encode on the codec threads, cut into a part per thread: they encode one chunk
        together, so the first of a batch is ready in about a thread's share of the time, and the chunks after
        it come ready one by one, in order (not two at once, each at half the pace). Its checksum, signature or
        encryption follows on a codec thread too, beside the transfer thread's I/O; queued after the parts,
        it never waits on a part that no thread has taken."""
        codec, job = self.fmt.encode_job(meta, raw, self._pool.threads)
        parts = [self._pool.submit(step) for step in job.steps]
        return self._pool.submit(self._seal_after, meta, codec, job, parts)

    def _seal_after(self, meta: ChunkMeta, codec: Codec, job: EncodeJob, parts: list[Future[None]]) -> Encoded:
        for part in parts:
            part.result()
        return self._sealed(meta, codec, job.finish)

    def _sealed(self, meta: ChunkMeta, codec: Codec, payload_of: Callable[[], Buffer]) -> Encoded:
        """A chunk's stored form from ``payload_of`` (its encode job's finish, or run): the checked payload
        and its header, or why the codec refused it."""
        try:
            payload = payload_of()
        except NonFiniteKVError as err:
            return Encoded(meta, b"", memoryview(b""), str(err))
        into = self._seal_buffers.take(self.fmt.sealed_len(payload)) if self.fmt.sealed else None
        header, payload = self.fmt.seal(meta, codec, payload, into)
        return Encoded(meta, header, memoryview(payload).cast("B"), sealed_in=into)

    def reads(self) -> ReadBatch:
        """A batch of reads on this thread; use it as a context manager so every decode is waited for."""
        buffers = getattr(self._landings, "buffers", None)
        if buffers is None:      # one landing while as many payloads as there are codec threads decode
            decoding = self._pool.threads if self._pool is not None else 0
            buffers = self._landings.buffers = [bytearray() for _ in range(1 + decoding)]
        return ReadBatch(self._pool, buffers)
