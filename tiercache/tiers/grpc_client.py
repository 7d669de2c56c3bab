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

Between hosts the bytes take the server's data channel when it has one
(``HealthReply.data_port``, ``grpc.bulk = auto``): a plain TCP connection per
transfer thread (`tiercache.tiers.data_client`) on which a value is received
straight into its L1 slot and sent straight out of it, since Python gRPC
makes every received message a fresh ``bytes`` on its channel thread; the
streamed ``Get`` / ``Put`` remain for servers without one.

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
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from tiercache.chunk_format import HEADER_BYTES, ChunkFormat, ChunkMeta, check_header, verify_payload
from tiercache.codecs import Buffer, copy_into
from tiercache.errors import ChunkFormatError
from tiercache.keys import BlockHash
from tiercache.server import tiercache_pb2 as pb
from tiercache.server import data_wire as dw
from tiercache.server.wire import AUTH_HEADER, PART_BYTES, ChunkView, WireError, method, read_chunk, split_chunk
from tiercache.tiers.data_client import DataChannel, StaleConnection
from tiercache.tiers.disk import chunk_path, write_all
from tiercache.tiers.remote import RemoteTier

log = logging.getLogger(__name__)

MIN_TRANSFER_RATE = 100e6   # bytes/s assumed when sizing a streaming call's deadline


def _identity(data: bytes) -> bytes:
    return data


_ABSENT = object()      # a chunk file that is not there (ask over the network)
PATH_MODES = ("auto", "off")


@dataclass(frozen=True, slots=True)
class _Paths:
    """How this client moves bytes to its server besides gRPC streams; asked once (again after an outage)."""
    local: Path | None = None           # this namespace's directory in the server's shared memory
    bulk: DataChannel | None = None     # the server's data channel


def _host(address: str) -> str:
    host = address.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") else host


class _FileSource:
    """A chunk file read as a `ValueSource`; a file shorter than its size said is a `ConnectionError`
    (it changed under us: read it over the network instead)."""

    def __init__(self, f) -> None:
        self._f = f

    def exactly(self, n: int) -> bytes:
        data = self._f.read(n)
        if len(data) != n:
            raise ConnectionError("chunk file ended early")
        return data

    def read_into(self, dest: memoryview) -> None:
        done = 0
        while done < len(dest):
            n = self._f.readinto(dest[done:])
            if not n:
                raise ConnectionError("chunk file ended early")
            done += n

    def skip(self, n: int) -> None:
        self._f.seek(n, os.SEEK_CUR)


class GrpcTier(RemoteTier):
    @property
    def parallel_jobs(self) -> bool:
        """One gRPC stream at a time (two contend for the GIL: 2.4 GB/s for one, 1.45 for two here), but file
        and socket I/O on the local path and the data channel release it: two workers read 10 GB/s from
        files where one reads 5.6."""
        paths = self._known_paths
        return paths is not None and (paths.local is not None or paths.bulk is not None)

    def __init__(self, address: str, namespace: bytes, fmt: ChunkFormat | None = None, auth_token: str | None = None,
                 timeout_s: float = 2.0, retry_interval_s: float = 1.0, max_message_bytes: int = 128 << 20,
                 name: str = "grpc", clock: Callable[[], float] = time.monotonic, local: str = "auto",
                 bulk: str = "auto") -> None:
        super().__init__(name, fmt, retry_interval_s, clock)
        for what, mode in (("local", local), ("bulk", bulk)):
            if mode not in PATH_MODES:
                raise ValueError(f"grpc tier {what} must be auto or off, got {mode!r}")
        self.address = address
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.max_message_bytes = max_message_bytes
        self._token = auth_token
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
        self._use_local, self._use_bulk = local == "auto", bulk == "auto"
        self._known_paths: _Paths | None = None     # None: not asked yet
        self._get = self._channel.unary_stream(method("Get"), _identity, _identity)
        self._put = self._channel.stream_unary(method("Put"), _identity, _identity)

    def close(self) -> None:
        self._forget_paths()
        self._channel.close()

    def health(self) -> pb.HealthReply:
        """The server's health (raises grpc.RpcError when it cannot be reached)."""
        reply = pb.HealthReply()
        reply.ParseFromString(self._health(pb.HealthRequest().SerializeToString(), timeout=self.timeout_s,
                                           metadata=self._metadata))
        return reply

    def _failed(self, what: str, err: Exception) -> None:
        super()._failed(what, err)
        self._forget_paths()     # a restarted server may offer other paths, or none

    def _forget_paths(self) -> None:
        paths, self._known_paths = self._known_paths, None
        if paths is not None and paths.bulk is not None:
            paths.bulk.close()

    def _paths(self) -> _Paths:
        """Ask the server, once, for its data channel and its shared-memory directory, and keep what this
        client can use. Raises grpc.RpcError when the server cannot be reached."""
        if self._known_paths is not None:
            return self._known_paths
        bulk = None
        if self._use_bulk:
            port = self.health().data_port
            if port:
                bulk = DataChannel(_host(self.address), port, self.namespace, self._token, self.timeout_s)
        paths = _Paths(self._local_dir() if self._use_local else None, bulk)
        self._known_paths = paths
        return paths

    def _local_dir(self) -> Path | None:
        """This namespace's directory in the server's shared memory, when this host sees it: None for a
        server without ``--shm-dir`` (or without the RPC), or a directory that is not this host's."""
        reply = pb.LocalReply()
        try:
            reply.ParseFromString(self._local_rpc(pb.LocalRequest().SerializeToString(), timeout=self.timeout_s,
                                                  metadata=self._metadata))
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
        if not reply.directory:
            return None
        directory = Path(reply.directory)
        try:
            seen = (directory / ".instance").read_text()
        except OSError:
            seen = None
        if seen != reply.instance:
            log.info("grpc tier %s: the server's directory %s is not this host's", self.name, directory)
            return None
        log.info("grpc tier %s: chunks move through %s on this host", self.name, directory)
        return directory / self.namespace.hex()

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
            paths = self._paths()
        except grpc.RpcError as err:
            self._failed("store", err)
            return [meta.key for meta, _ in items]
        if paths.local is not None:
            failed = self._write_local(paths.local, items)
            if failed is not None:
                return failed
        if paths.bulk is not None:
            return self._write_bulk(paths.bulk, items)

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
            paths = self._known_paths
            if paths is not None:
                self._known_paths = _Paths(None, paths.bulk)
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

    def _on_bulk(self, bulk: DataChannel, call: Callable[[DataChannel], list]) -> list:
        """``call`` on the data channel; a kept connection that failed (the server may have restarted, on
        another port) is given one more try after asking the server again. Raises ConnectionError or
        grpc.RpcError."""
        try:
            return call(bulk)
        except StaleConnection:
            self._forget_paths()
            bulk = self._paths().bulk
            if bulk is None:
                raise ConnectionError("the server no longer has a data channel") from None
            return call(bulk)

    def _write_bulk(self, bulk: DataChannel, items: Sequence[tuple[ChunkMeta, Buffer]]) -> list[BlockHash]:
        """One ``PUT`` on the data channel: each chunk's header and payload sent as they are."""
        chunks = [(meta.key, *self.fmt.encode_parts(meta, raw)) for meta, raw in items]
        try:
            outcomes = self._on_bulk(bulk, lambda channel: channel.put(chunks))
        except (ConnectionError, grpc.RpcError) as err:
            self._failed("store", err)
            return [meta.key for meta, _ in items]
        self._outage.succeeded()
        return [meta.key for (meta, _), outcome in zip(items, outcomes) if outcome == dw.PUT_REJECTED]

    @staticmethod
    def _discard(incoming: Path, names: Sequence[str]) -> None:
        for name in names:
            try:
                (incoming / name).unlink(missing_ok=True)
            except OSError:
                pass

    def read_chunks_into(self, items: Sequence[tuple[BlockHash, memoryview]]) -> list[int | None]:
        """Each chunk verified and decoded into its buffer: read from the server's files when co-located,
        else (and for files not there) from one ``GET`` on the data channel, or one streamed ``Get``.

        Returns the raw length placed per item, or None for a miss, a corrupt
        or foreign chunk, or an unreachable server.
        """
        out: list[int | None] = [None] * len(items)
        if not items or not self.available:
            return out
        try:
            paths = self._paths()
        except grpc.RpcError as err:
            self._failed("load", err)
            return out
        if paths.local is None:
            return self._read_network(paths, items)
        remote, read = [], []
        for i, (key, buf) in enumerate(items):
            got = self._read_file(paths.local, key, buf)
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
            for i, got in zip(remote, self._read_network(paths, [items[i] for i in remote])):
                out[i] = got
        return out

    def _read_network(self, paths: _Paths, items: Sequence[tuple[BlockHash, memoryview]]) -> list[int | None]:
        if paths.bulk is None:
            return self._read_remote(items)
        def receive(reader, n: int, key: BlockHash, buf: memoryview) -> int | None:
            return self.receive_value(reader, n, self.namespace, key, buf)
        try:
            out = self._on_bulk(paths.bulk, lambda channel: channel.get(items, receive))
        except (ConnectionError, grpc.RpcError) as err:
            self._failed("load", err)
            return [None] * len(items)
        self._outage.succeeded()
        return out

    def _read_file(self, root: Path, key: BlockHash, buf: memoryview) -> int | None | object:
        """One chunk from its file in the server's directory, verified in place: its raw length, None if it
        is corrupt or foreign, `_ABSENT` if there is no such file (or it went away mid-read)."""
        try:
            f = open(chunk_path(root, key), "rb", buffering=0)
        except OSError:
            return _ABSENT
        with f:
            try:
                return self.receive_value(_FileSource(f), os.fstat(f.fileno()).st_size, self.namespace, key, buf)
            except (OSError, ConnectionError):
                return _ABSENT

    def _read_remote(self, items: Sequence[tuple[BlockHash, memoryview]]) -> list[int | None]:
        """One streamed gRPC ``Get``."""
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
