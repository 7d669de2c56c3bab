"""Payload codecs and checksums for stored chunks, chosen by name from registries.

Runs on the worker side inside transfer handlers. Each codec and checksum has a
stable one-byte code written into the chunk header, so a reader can decode a
chunk whatever its own configuration. A codec sees a chunk as a `ChunkLayout`
(the dtype and shape of its raw bytes); the lossy ones (KV quantization,
`tiercache.kv_quant`) say so, and their name goes into the storage digest.
"""
from __future__ import annotations

import functools
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np

from tiercache.contracts.layout import ChunkLayout
from tiercache.errors import CodecError
from tiercache.registry import Registry

Buffer = bytes | bytearray | memoryview

class Codec(Protocol):
    name: ClassVar[str]
    code: ClassVar[int]
    lossy: ClassVar[bool]     # decodes to other values than were encoded: named in the storage digest

    def accepts(self, layout: ChunkLayout) -> bool:
        """Whether this codec applies to such a chunk (where not, the chunk is stored raw)."""
        ...

    def encode(self, raw: memoryview, layout: ChunkLayout) -> Buffer: ...

    def decode_into(self, payload: memoryview, layout: ChunkLayout, out: memoryview) -> None:
        """Decode into ``out`` (``layout.raw_len`` bytes); `CodecError` for a payload that does not decode."""
        ...

    def max_encoded_len(self, layout: ChunkLayout) -> int: ...


@dataclass(frozen=True, slots=True)
class EncodeJob:
    """One chunk's encode cut into independent ``steps`` (each may run on a thread of its own, in any order)
    and ``finish``, which returns the payload once every step has run (and may refuse it: `NonFiniteKVError`)."""
    steps: tuple[Callable[[], None], ...]
    finish: Callable[[], Buffer]

    def run(self) -> Buffer:
        """Every step here, in order, then the payload."""
        for step in self.steps:
            step()
        return self.finish()


class SplitEncoder(Protocol):
    """A codec whose encode of one chunk splits into parts over disjoint ranges of the chunk: several codec
    threads encode one chunk together, so its payload is ready sooner than one thread would make it."""

    def encode_job(self, raw: memoryview, layout: ChunkLayout, parts: int) -> EncodeJob: ...


def encode_job(codec: Codec, raw: memoryview, layout: ChunkLayout, parts: int) -> EncodeJob:
    """``codec``'s encode of one chunk as an `EncodeJob`: cut into up to ``parts`` steps by a `SplitEncoder`,
    one step otherwise."""
    if parts > 1 and hasattr(codec, "encode_job"):
        return codec.encode_job(raw, layout, parts)
    out: list[Buffer] = []
    return EncodeJob((lambda: out.append(codec.encode(raw, layout)),), lambda: out[0])


class RunningChecksum(Protocol):
    def update(self, data: Buffer) -> None: ...

    def intdigest(self) -> int: ...


class Checksum(Protocol):
    name: ClassVar[str]
    code: ClassVar[int]

    def __call__(self, data: Buffer) -> int: ...

    def running(self) -> RunningChecksum:
        """The same checksum fed piece by piece (a value hashed as it arrives, while it is in cache)."""
        ...


codecs: Registry[type[Codec]] = Registry("codec")
checksums: Registry[type[Checksum]] = Registry("checksum")


@codecs.register("raw")
class RawCodec:
    name = "raw"
    code = 0
    lossy = False

    def accepts(self, layout: ChunkLayout) -> bool:
        return True

    def encode(self, raw: memoryview, layout: ChunkLayout) -> Buffer:
        return raw

    def decode_into(self, payload: memoryview, layout: ChunkLayout, out: memoryview) -> None:
        if len(payload) != layout.raw_len:
            raise CodecError(f"raw payload is {len(payload)} bytes, header says {layout.raw_len}")
        copy_into(out, payload)

    def max_encoded_len(self, layout: ChunkLayout) -> int:
        return layout.raw_len


@codecs.register("lz4")
class Lz4Codec:
    """LZ4 block format; the raw length lives in the chunk header, not the block."""
    name = "lz4"
    code = 1
    lossy = False

    def accepts(self, layout: ChunkLayout) -> bool:
        return True

    def max_encoded_len(self, layout: ChunkLayout) -> int:
        return layout.raw_len + layout.raw_len // 255 + 16   # LZ4's worst case for incompressible input

    def encode(self, raw: memoryview, layout: ChunkLayout) -> Buffer:
        import lz4.block
        return lz4.block.compress(raw, store_size=False)

    def decode_into(self, payload: memoryview, layout: ChunkLayout, out: memoryview) -> None:
        copy_into(out, self._decompress(payload, layout.raw_len))

    @staticmethod
    def _decompress(payload: memoryview, raw_len: int) -> bytes:
        import lz4.block
        try:
            out = lz4.block.decompress(payload, uncompressed_size=raw_len)
        except lz4.block.LZ4BlockError as err:
            raise CodecError(f"lz4 payload does not decode: {err}") from None
        if len(out) != raw_len:
            raise CodecError(f"lz4 payload decodes to {len(out)} bytes, header says {raw_len}")
        return out


@codecs.register("lz4-shuffle")
class Lz4ShuffleCodec(Lz4Codec):
    """Byte-plane shuffle (all low bytes, then all high bytes) before LZ4.

    The exponent bytes of 16-bit floats repeat far more than the mantissa
    bytes, so grouping them gives LZ4 runs to find. Falls back to plain LZ4
    for 1-byte dtypes.
    """
    name = "lz4-shuffle"
    code = 2

    def encode(self, raw: memoryview, layout: ChunkLayout) -> Buffer:
        itemsize = layout.itemsize
        if itemsize > 1 and len(raw) % itemsize == 0:
            planes = np.frombuffer(raw, dtype=np.uint8).reshape(-1, itemsize).T.copy()
            raw = memoryview(planes).cast("B")
        return super().encode(raw, layout)

    def decode_into(self, payload: memoryview, layout: ChunkLayout, out: memoryview) -> None:
        data, itemsize = self._decompress(payload, layout.raw_len), layout.itemsize
        if itemsize > 1 and layout.raw_len % itemsize == 0:
            planes = np.frombuffer(data, dtype=np.uint8).reshape(itemsize, -1)
            np.frombuffer(out, dtype=np.uint8)[:layout.raw_len].reshape(-1, itemsize)[:] = planes.T
        else:
            copy_into(out, data)


codecs.register("int8", "tiercache.kv_quant:Int8Codec")
codecs.register("fp8-e4m3", "tiercache.kv_quant:Fp8E4M3Codec")


@checksums.register("xxh3_64")
class Xxh3Checksum:
    name = "xxh3_64"
    code = 1

    def __call__(self, data: Buffer) -> int:
        import xxhash
        return xxhash.xxh3_64_intdigest(data)

    def running(self) -> RunningChecksum:
        import xxhash
        return xxhash.xxh3_64()


@checksums.register("crc32")
class Crc32Checksum:
    name = "crc32"
    code = 2

    def __call__(self, data: Buffer) -> int:
        return zlib.crc32(data)

    def running(self) -> RunningChecksum:
        return _RunningCrc32()


class _RunningCrc32:
    def __init__(self) -> None:
        self._value = 0

    def update(self, data: Buffer) -> None:
        self._value = zlib.crc32(data, self._value)

    def intdigest(self) -> int:
        return self._value


def copy_into(dst: memoryview, src: Buffer, offset: int = 0) -> int:
    """Copy ``src`` into ``dst`` at ``offset`` without holding the GIL (numpy releases it for the memcpy;
    a memoryview slice assignment does not, and stalls gRPC's and other transfer threads meanwhile).
    Returns the end offset."""
    data = np.frombuffer(src, dtype=np.uint8)
    np.frombuffer(dst, dtype=np.uint8)[offset:offset + data.size] = data
    return offset + data.size


def _by_code(registry: Registry, code: int, what: str):
    for name in registry.names():
        cls = registry.get(name)
        if cls.code == code:
            return cls
    raise CodecError(f"unknown {what} code {code}")


def codec_by_code(code: int) -> type[Codec]:
    return _by_code(codecs, code, "codec")


@functools.cache
def decoder(code: int) -> Codec:
    """The one instance that decodes payloads of codec ``code`` in this process (a codec's scratch is per
    thread, so one instance serves every thread; a fresh one per chunk would fault its scratch in again)."""
    return codec_by_code(code)()


def checksum_by_code(code: int) -> type[Checksum]:
    return _by_code(checksums, code, "checksum")
