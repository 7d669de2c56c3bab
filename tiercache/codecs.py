"""Payload codecs and checksums for stored chunks, chosen by name from registries.

Runs on the worker side inside transfer handlers. Each codec and checksum has a
stable one-byte code written into the chunk header, so a reader can decode a
chunk whatever its own configuration.
"""
from __future__ import annotations

import zlib
from typing import ClassVar, Protocol

import numpy as np

from tiercache.errors import CodecError
from tiercache.registry import Registry

Buffer = bytes | bytearray | memoryview


class Codec(Protocol):
    name: ClassVar[str]
    code: ClassVar[int]

    def encode(self, raw: memoryview, itemsize: int) -> Buffer: ...

    def decode(self, payload: memoryview, raw_len: int, itemsize: int) -> Buffer: ...

    def max_encoded_len(self, raw_len: int) -> int: ...


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

    def encode(self, raw: memoryview, itemsize: int) -> Buffer:
        return raw

    def decode(self, payload: memoryview, raw_len: int, itemsize: int) -> Buffer:
        if len(payload) != raw_len:
            raise CodecError(f"raw payload is {len(payload)} bytes, header says {raw_len}")
        return payload

    def max_encoded_len(self, raw_len: int) -> int:
        return raw_len


@codecs.register("lz4")
class Lz4Codec:
    """LZ4 block format; the raw length lives in the chunk header, not the block."""
    name = "lz4"
    code = 1

    def max_encoded_len(self, raw_len: int) -> int:
        return raw_len + raw_len // 255 + 16   # LZ4's worst case for incompressible input

    def encode(self, raw: memoryview, itemsize: int) -> Buffer:
        import lz4.block
        return lz4.block.compress(raw, store_size=False)

    def decode(self, payload: memoryview, raw_len: int, itemsize: int) -> Buffer:
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

    def encode(self, raw: memoryview, itemsize: int) -> Buffer:
        if itemsize > 1 and len(raw) % itemsize == 0:
            planes = np.frombuffer(raw, dtype=np.uint8).reshape(-1, itemsize).T.copy()
            raw = memoryview(planes).cast("B")
        return super().encode(raw, itemsize)

    def decode(self, payload: memoryview, raw_len: int, itemsize: int) -> Buffer:
        out = super().decode(payload, raw_len, itemsize)
        if itemsize > 1 and raw_len % itemsize == 0:
            return np.frombuffer(out, dtype=np.uint8).reshape(itemsize, -1).T.tobytes()
        return out


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


def checksum_by_code(code: int) -> type[Checksum]:
    return _by_code(checksums, code, "checksum")
