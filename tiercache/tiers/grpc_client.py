"""L3 on a shared `tiercache serve`: the gRPC client tier.

Like the Redis tier, the server owns the data and this tier keeps no index:
`contains` is one ``Contains`` call, stores are one client-streamed ``Put``
per transfer job, loads one server-streamed ``Get``. Chunks travel in the
stored chunk format (encoded here, header checked by the server, payload
checksum verified here on every read), split into pieces of a few MiB and
built and parsed by hand on the wire (`tiercache.server.wire`): a piece is
copied once on the way out, and on the way in a raw chunk's pieces are copied
straight into their L1 slot and verified there.

Co-located with a server started with ``--shm-dir`` (and ``grpc.local =
auto``), the bytes skip gRPC: the server's memory tier is chunk files in a
tmpfs directory, which this tier reads straight into the L1 slots (verifying
each; a file missing there is asked for over ``Get``, since the server may
hold it on disk) and writes new chunks into, handing them over with one
``Adopt`` call per job; reads are reported with ``Touch`` so the server's
policy and counters see them. The directory is trusted only when its
``.instance`` token matches the server's ``Local`` reply (the same host and
mount), and is asked for again after any outage.

Faults: every call has a deadline; a server that is gone, slow or refusing
(``UNAVAILABLE``, ``DEADLINE_EXCEEDED``, ``UNAUTHENTICATED``, ...) turns into
misses and failed stores, and the tier goes quiet for a backoff (`Outage`),
while the gRPC channel reconnects in the background (its own reconnect
backoff is capped at ``retry_interval`` too, so a restarted server is seen
within seconds).
"""
from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import grpc

from tiercache.chunk_format import HEADER_BYTES, ChunkFormat, ChunkMeta, check_header, verify_payload
from tiercache.codecs import Buffer, copy_into
from tiercache.errors import ChunkFormatError, TruncatedChunkError
from tiercache.keys import BlockHash
from tiercache.server import tiercache_pb2 as pb
from tiercache.server.wire import AUTH_HEADER, PART_BYTES, ChunkView, WireError, method, read_chunk, split_chunk
from tiercache.tiers.disk import chunk_path, write_all
from tiercache.tiers.remote import RemoteTier

log = logging.getLogger(__name__)

MIN_TRANSFER_RATE = 100e6   # bytes/s assumed when sizing a streaming call's deadline


def _identity(data: bytes) -> bytes:
    return data


_UNASKED = object()     # the server has not been asked for its local directory yet
_ABSENT = object()      # a chunk file that is not there (ask over gRPC)


class GrpcTier(RemoteTier):
    @property
    def parallel_jobs(self) -> bool:
        """One gRPC stream at a time (two contend for the GIL: 2.4 GB/s for one, 1.45 for two here), but file
        reads and writes on the local path release it: two workers read 10 GB/s where one reads 5.6."""
        return isinstance(self._local_root, Path)

    def __init__(self, address: str, namespace: bytes, fmt: ChunkFormat | None = None, auth_token: str | None = None,
                 timeout_s: float = 2.0, retry_interval_s: float = 1.0, max_message_bytes: int = 128 << 20,
                 name: str = "grpc", clock: Callable[[], float] = time.monotonic, local: str = "auto") -> None:
        super().__init__(name, fmt, retry_interval_s, clock)
        self.address = address
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.max_message_bytes = max_message_bytes
        self._metadata = ((AUTH_HEADER, f"Bearer {auth_token}"),) if auth_token else ()
        backoff_ms = max(100, int(retry_interval_s * 1000))
        self._channel = grpc.insecure_channel(address, options=[
            ("grpc.max_send_message_length", max_message_bytes * 2),
            ("grpc.max_receive_message_length", max_message_bytes * 2),
            ("grpc.initial_reconnect_backoff_ms", backoff_ms),
            ("grpc.min_reconnect_backoff_ms", backoff_ms),
            ("grpc.max_reconnect_backoff_ms", backoff_ms * 4),
            ("grpc.enable_retries", 0),
        ])
        unary = {n: self._channel.unary_unary(method(n), _identity, _identity)
                 for n in ("Contains", "Delete", "Health", "Local", "Adopt", "Touch")}
        self._contains, self._delete, self._health = unary["Contains"], unary["Delete"], unary["Health"]
        self._local_rpc, self._adopt, self._touch = unary["Local"], unary["Adopt"], unary["Touch"]
        self._use_local = local == "auto"
        self._local_root: object = _UNASKED     # Path of this namespace's directory, None, or _UNASKED
        self._thread = threading.local()
        self._get = self._channel.unary_stream(method("Get"), _identity, _identity)
        self._put = self._channel.stream_unary(method("Put"), _identity, _identity)

    def close(self) -> None:
        self._channel.close()

    def health(self) -> pb.HealthReply:
        """The server's health (raises grpc.RpcError when it cannot be reached)."""
        reply = pb.HealthReply()
        reply.ParseFromString(self._health(pb.HealthRequest().SerializeToString(), timeout=self.timeout_s,
                                           metadata=self._metadata))
        return reply

    def _failed(self, what: str, err: Exception) -> None:
        super()._failed(what, err)
        self._local_root = _UNASKED     # a restarted server may offer another directory, or none

    def _local_dir(self) -> Path | None:
        """This namespace's directory in the server's shared memory, when this client can use it.

        Asked once (again after an outage); raises grpc.RpcError when the
        server cannot be reached. A server without the RPC or without
        ``--shm-dir``, or a directory this host does not see, means None.
        """
        root = self._local_root
        if root is not _UNASKED:
            return root     # type: ignore[return-value]
        if not self._use_local:
            root = None
        else:
            reply = pb.LocalReply()
            try:
                reply.ParseFromString(self._local_rpc(pb.LocalRequest().SerializeToString(), timeout=self.timeout_s,
                                                      metadata=self._metadata))
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
            root = None
            if reply.directory:
                directory = Path(reply.directory)
                try:
                    seen = (directory / ".instance").read_text()
                except OSError:
                    seen = None
                if seen == reply.instance:
                    root = directory / self.namespace.hex()
                    log.info("grpc tier %s: chunks move through %s on this host", self.name, directory)
                else:
                    log.info("grpc tier %s: the server's directory %s is not this host's; using gRPC",
                             self.name, directory)
        self._local_root = root
        return root

    def _staging(self, nbytes: int) -> memoryview:
        """A reusable per-thread buffer for compressed payloads read from files."""
        buf = getattr(self._thread, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = self._thread.buf = bytearray(nbytes)
        return memoryview(buf)[:nbytes]

    def _present(self, keys: Sequence[BlockHash]) -> int:
        request = pb.ContainsRequest(namespace=self.namespace, keys=keys).SerializeToString()
        reply = pb.ContainsReply()
        reply.ParseFromString(self._contains(request, timeout=self.timeout_s, metadata=self._metadata))
        return min(reply.present, len(keys))

    def contains(self, keys: Sequence[BlockHash]) -> int:
        if not keys or not self.available:
            return self._count_lookup(len(keys), 0)
        try:
            n = self._present(keys)
        except grpc.RpcError as err:
            self._failed("lookup", err)
            return self._count_lookup(len(keys), 0)
        self._outage.succeeded()
        return self._count_lookup(len(keys), n)

    def has(self, key: BlockHash) -> bool:
        if not self.available:
            return False
        try:
            return self._present([key]) == 1
        except grpc.RpcError as err:
            self._failed("lookup", err)
            return False

    def delete(self, keys: Sequence[BlockHash]) -> int:
        if not keys or not self.available:
            return 0
        try:
            reply = pb.DeleteReply()
            reply.ParseFromString(self._delete(pb.DeleteRequest(namespace=self.namespace, keys=keys).SerializeToString(),
                                               timeout=self.timeout_s, metadata=self._metadata))
        except grpc.RpcError as err:
            self._failed("delete", err)
            return 0
        self.counters.deleted += reply.deleted
        return reply.deleted

    def prepare_store(self, keys: Sequence[BlockHash], nbytes: Sequence[int]) -> list[bool]:
        ok = self.available
        if not ok:
            self.counters.store_rejected += len(keys)
        return [ok] * len(keys)

    @property
    def part_bytes(self) -> int:
        """Value bytes per message: `PART_BYTES`, or less when the server accepts only smaller messages."""
        return min(PART_BYTES, self.max_message_bytes - 1024)

    # -- I/O (worker side) ---------------------------------------------------
    def _deadline(self, nbytes: int) -> float:
        return self.timeout_s + nbytes / MIN_TRANSFER_RATE

    def write_chunks(self, items: Sequence[tuple[ChunkMeta, Buffer]]) -> list[BlockHash]:
        """One streamed ``Put`` of every chunk; returns the keys that were not stored."""
        if not items:
            return []
        if not self.available:
            return [meta.key for meta, _ in items]

        try:
            root = self._local_dir()
        except grpc.RpcError as err:
            self._failed("store", err)
            return [meta.key for meta, _ in items]
        if root is not None:
            failed = self._write_local(root, items)
            if failed is not None:
                return failed

        def messages() -> Iterator[bytes]:
            for meta, raw in items:
                header, payload = self.fmt.encode_parts(meta, raw)
                yield from split_chunk(self.namespace, meta.key, header, payload, self.part_bytes)

        nbytes = sum(len(memoryview(raw).cast("B")) for _, raw in items)
        try:
            reply = pb.PutReply()
            reply.ParseFromString(self._put(messages(), timeout=self._deadline(nbytes), metadata=self._metadata))
        except grpc.RpcError as err:
            self._failed("store", err)
            return [meta.key for meta, _ in items]
        self._outage.succeeded()
        return [BlockHash(k) for k in reply.rejected]

    def _write_local(self, root: Path, items: Sequence[tuple[ChunkMeta, Buffer]]) -> list[BlockHash] | None:
        """Write the chunks as files into the server's incoming directory and ``Adopt`` them; returns the
        keys not stored, or None when the files could not be written (the caller streams a ``Put``)."""
        incoming = root / "incoming"
        names: list[str] = []
        try:
            incoming.mkdir(parents=True, exist_ok=True)
            for meta, raw in items:
                header, payload = self.fmt.encode_parts(meta, raw)
                names.append(f"{secrets.token_hex(16)}.tmp")
                fd = os.open(incoming / names[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    write_all(fd, memoryview(header), memoryview(payload).cast("B"))
                finally:
                    os.close(fd)
        except OSError as err:     # no permission, tmpfs full, directory gone: gRPC until the next outage
            log.warning("grpc tier %s: writing chunk files to %s failed (%s); moving chunks over gRPC",
                        self.name, incoming, err)
            self._discard(incoming, names)
            self._local_root = None
            return None
        request = pb.AdoptRequest(namespace=self.namespace, keys=[m.key for m, _ in items], files=names)
        reply = pb.PutReply()
        try:
            reply.ParseFromString(self._adopt(request.SerializeToString(), timeout=self.timeout_s,
                                              metadata=self._metadata))
        except grpc.RpcError as err:
            self._discard(incoming, names)
            self._failed("store", err)
            return [meta.key for meta, _ in items]
        self._outage.succeeded()
        return [BlockHash(k) for k in reply.rejected]

    @staticmethod
    def _discard(incoming: Path, names: Sequence[str]) -> None:
        for name in names:
            try:
                (incoming / name).unlink(missing_ok=True)
            except OSError:
                pass

    def read_chunks_into(self, items: Sequence[tuple[BlockHash, memoryview]]) -> list[int | None]:
        """Each chunk verified and decoded into its buffer: read from the server's files when co-located,
        else (and for files not there) from one streamed ``Get``.

        Returns the raw length placed per item, or None for a miss, a corrupt
        or foreign chunk, or an unreachable server.
        """
        out: list[int | None] = [None] * len(items)
        if not items or not self.available:
            return out
        try:
            root = self._local_dir()
        except grpc.RpcError as err:
            self._failed("load", err)
            return out
        if root is None:
            return self._read_remote(items)
        remote, read = [], []
        for i, (key, buf) in enumerate(items):
            got = self._read_file(root, key, buf)
            if got is _ABSENT:
                remote.append(i)
            else:
                out[i] = got    # type: ignore[assignment]
                if got is not None:
                    read.append(key)
        if read:
            try:
                self._touch(pb.TouchRequest(namespace=self.namespace, keys=read).SerializeToString(),
                            timeout=self.timeout_s, metadata=self._metadata)
            except grpc.RpcError as err:   # the bytes are here and verified; only the server's bookkeeping missed
                log.debug("grpc tier %s: Touch failed: %s", self.name, err)
        if remote:
            for i, got in zip(remote, self._read_remote([items[i] for i in remote])):
                out[i] = got
        return out

    def _read_file(self, root: Path, key: BlockHash, buf: memoryview) -> int | None | object:
        """One chunk from its file in the server's directory, verified in place: its raw length, None if it
        is corrupt or foreign, `_ABSENT` if there is no such file."""
        try:
            f = open(chunk_path(root, key), "rb", buffering=0)
        except OSError:
            return _ABSENT
        with f:
            try:
                parsed = check_header(f.read(HEADER_BYTES), self.namespace, key)
                meta, codec, _, payload_len, _ = parsed
                size = os.fstat(f.fileno()).st_size
                if size != HEADER_BYTES + payload_len:
                    raise TruncatedChunkError(f"file is {size} bytes, its header says {HEADER_BYTES + payload_len}")
                if meta.raw_len > len(buf):
                    raise ChunkFormatError(f"chunk of {meta.raw_len} B does not fit a {len(buf)}-byte buffer")
                raw = codec == 0 and payload_len == meta.raw_len
                landing = buf[:payload_len] if raw else self._staging(payload_len)
                done = 0
                while done < payload_len:
                    n = f.readinto(landing[done:])
                    if not n:
                        raise TruncatedChunkError(f"file ended after {HEADER_BYTES + done} bytes")
                    done += n
                data = verify_payload(parsed, landing)
                if not raw:
                    copy_into(buf, data)
                return meta.raw_len
            except ChunkFormatError as err:
                log.warning("grpc tier %s: chunk file %s… failed verification: %s", self.name, key.hex()[:16], err)
                return None
            except OSError:
                return _ABSENT

    def _read_remote(self, items: Sequence[tuple[BlockHash, memoryview]]) -> list[int | None]:
        """One streamed ``Get``."""
        out: list[int | None] = [None] * len(items)
        request = pb.GetRequest(namespace=self.namespace, keys=[k for k, _ in items]).SerializeToString()
        nbytes = sum(len(buf) for _, buf in items)
        try:
            stream = iter(self._get(request, timeout=self._deadline(nbytes), metadata=self._metadata))
            for i, item in enumerate(items):
                got = read_chunk(stream)
                if got is None:
                    break
                out[i] = self._place(item, got[0], got[1])
        except grpc.RpcError as err:
            self._failed("load", err)
            return [None] * len(items)
        except WireError as err:   # a broken stream: what was placed stands, the rest are misses
            log.warning("grpc tier %s: malformed Get stream: %s", self.name, err)
            self.counters.errors += 1
        self._outage.succeeded()
        return out

    def _place(self, item: tuple[BlockHash, memoryview], head: ChunkView, pieces: list[memoryview]) -> int | None:
        """Verify one chunk and leave its raw bytes at the start of the item's buffer; None for a miss."""
        key, buf = item
        if not head.value:
            return None
        try:
            if head.namespace != self.namespace or head.key != key:
                raise ChunkFormatError("the server answered for another namespace or key")
            parsed = check_header(pieces[0][:HEADER_BYTES], self.namespace, key)
            meta, codec, _, payload_len, _ = parsed
            if head.total != HEADER_BYTES + payload_len:
                raise ChunkFormatError(f"value is {head.total} bytes, its header says {HEADER_BYTES + payload_len}")
            if meta.raw_len > len(buf):
                raise ChunkFormatError(f"chunk of {meta.raw_len} B does not fit a {len(buf)}-byte buffer")
            body = [pieces[0][HEADER_BYTES:], *pieces[1:]]
            if codec == 0 and payload_len == meta.raw_len:   # raw: pieces straight into place, verified there
                offset = 0
                for piece in body:
                    offset = copy_into(buf, piece, offset)
                verify_payload(parsed, buf[:payload_len])
                return payload_len
            data = verify_payload(parsed, body[0] if len(body) == 1 else b"".join(body))
            copy_into(buf, data)
            return meta.raw_len
        except ChunkFormatError as err:
            log.warning("grpc tier %s: chunk %s… failed verification: %s", self.name, key.hex()[:16], err)
            return None
