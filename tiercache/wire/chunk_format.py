"""The self-describing stored chunk: header + payload (docs/architecture.md, wire formats).

Worker side. Every read from L2/L3 goes through `ChunkFormat.decode`, which
verifies the header's own CRC, magic, version, namespace, key, lengths and the
payload checksum before any byte is handed on; any failure raises a
`ChunkFormatError` subclass that the caller counts and turns into a miss.

Header (little endian, 164 bytes = HEADER_BYTES):
    magic "TCKV" | version u16 | header_len u16 | codec u8 | checksum u8 |
    dtype u8 | ndim u8 | namespace 16s | key 32s | parent 32s | stored_at f64 |
    num_tokens u32 | raw_len u64 | payload_len u64 | payload_checksum u64 |
    shape 8×u32 | header_crc32 u32

``parent`` is the key of the chunk before this one in its request (zeros for a
request's first chunk): a store can then find every chunk whose chain passes
through a given one without the engine that wrote it (a purge by prompt,
`tiercache.contracts.purge`). ``stored_at`` is when the chunk was first stored
(an engine's L1; unix seconds, 0: unknown): a store without an index of its
own (Redis) can then be purged by age. Version 1 chunks are refused as any
unknown version is: a miss, deleted at a disk tier's start.
"""
from __future__ import annotations

import hmac
import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from tiercache.codecs import (
    Buffer,
    ChunkLayout,
    Codec,
    EncodeJob,
    checksum_by_code,
    checksums,
    codecs,
    decoder,
    encode_job,
)
from tiercache.contracts.keys import HASH_BYTES, NAMESPACE_DIGEST_BYTES, BlockHash
from tiercache.errors import (
    ChecksumMismatchError,
    CorruptHeaderError,
    KeyMismatchError,
    NamespaceMismatchError,
    SignatureError,
    TierCacheError,
    TruncatedChunkError,
)
from tiercache.log_limits import ThrottledLog

MAGIC = b"TCKV"
VERSION = 2
MAX_DIMS = 8
_BODY = struct.Struct(f"<4sHHBBBB{NAMESPACE_DIGEST_BYTES}s{HASH_BYTES}s{HASH_BYTES}sdIQQQ{MAX_DIMS}I")
_CRC = struct.Struct("<I")
HEADER_BYTES = _BODY.size + _CRC.size

DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3, "float8_e4m3fn": 4, "float8_e5m2": 5, "int8": 6, "uint8": 7}
DTYPE_NAMES = {v: k for k, v in DTYPE_CODES.items()}


@dataclass(frozen=True, slots=True)
class ChunkMeta:
    namespace: bytes          # namespace digest
    key: BlockHash
    num_tokens: int
    dtype: str
    shape: tuple[int, ...]
    parent: BlockHash | None = None   # the chunk before this one in its request (None: the first)
    stored_at: float = 0.0            # when it was first stored (unix seconds; 0: unknown)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"dtype {self.dtype!r} cannot be stored; known: {', '.join(DTYPE_CODES)}")
        if len(self.shape) > MAX_DIMS:
            raise ValueError(f"shape {self.shape} has more than {MAX_DIMS} dims")

    @property
    def layout(self) -> ChunkLayout:
        return ChunkLayout(self.dtype, self.shape)

    @property
    def raw_len(self) -> int:
        return self.layout.raw_len


ParsedHeader = tuple[ChunkMeta, int, int, int, int]   # meta, codec code, checksum code, payload length, checksum


@dataclass(frozen=True, slots=True)
class DecodedChunk:
    meta: ChunkMeta
    data: Buffer   # raw payload bytes, verified


SIGNED = 0x80          # checksum code of a signed chunk: its payload sum is a MAC (`ChunkSigner`)
_SIGNED_FIELDS = struct.Struct(f"<{NAMESPACE_DIGEST_BYTES}s{HASH_BYTES}s{HASH_BYTES}sdIBBQQ")
NO_PARENT = bytes(HASH_BYTES)


def _signed_fields(meta: ChunkMeta, codec_code: int, payload_len: int) -> bytes:
    """What a signature or a seal covers of a header, beside the shape (and a seal's key id)."""
    return _SIGNED_FIELDS.pack(meta.namespace, meta.key, meta.parent or NO_PARENT, meta.stored_at, meta.num_tokens,
                               DTYPE_CODES[meta.dtype], codec_code, meta.raw_len, payload_len)


class _Mac:
    def __init__(self, mac: hmac.HMAC) -> None:
        self._mac = mac

    def update(self, data: Buffer) -> None:
        self._mac.update(data)

    def intdigest(self) -> int:
        return int.from_bytes(self._mac.digest()[:8], "little")


class ChunkSigner:
    """A tenant's secret, which never leaves its clients: each chunk's payload sum is HMAC-SHA256 (its first
    8 bytes) over what the header says — namespace, key, tokens, dtype, shape, lengths, codec — and the
    payload, so whoever can write to a store (a peer on a shared Redis, a compromised server) cannot make a
    chunk an engine with this key will use, nor pass one chunk off as another."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError(f"a signing key of {len(key)} bytes is too short (16 or more)")
        self._key = key

    def running(self, meta: ChunkMeta, codec_code: int, payload_len: int) -> _Mac:
        mac = hmac.new(self._key, digestmod="sha256")
        mac.update(_signed_fields(meta, codec_code, payload_len))
        mac.update(struct.pack(f"<{len(meta.shape)}Q", *meta.shape))
        return _Mac(mac)

    def sign(self, meta: ChunkMeta, codec_code: int, payload: Buffer) -> int:
        mac = self.running(meta, codec_code, len(memoryview(payload).cast("B")))
        mac.update(payload)
        return mac.intdigest()


SEALED = 0x81          # checksum code of an encrypted chunk: AES-256-GCM (`ChunkSealer`); its sum field is the key id
NONCE_BYTES = 12
TAG_BYTES = 16
SEAL_OVERHEAD = NONCE_BYTES + TAG_BYTES     # a sealed payload is nonce | ciphertext | tag
KEYED = (SIGNED, SEALED)                    # chunks only their tenant's clients can check


KEYS_CHECK_S = 1.0      # how often a sealer looks for a rotated keys file (a stat when nothing changed)
_keys_log = ThrottledLog(logging.getLogger(__name__))

SEAL_PIECE = 4 << 20    # bytes encrypted or decrypted per step: each piece still in cache


class ChunkSealer:
    """A tenant's encryption keys, which never leave its clients (engines): every payload stored below L1 is
    AES-256-GCM under the active key, a random 96-bit nonce per chunk, with what the header says —
    namespace, key, tokens, dtype, shape, lengths, codec, key id — as associated data. Chunk files, Redis
    values and the server's values are then ciphertext, and the tag authenticates header and payload as
    the HMAC of `ChunkSigner` does (sealing subsumes signing). Keys have ids: after a rotation the old keys
    stay here to read old chunks for a grace period while new ones are written under the new key; a chunk
    under a key not here (another tenant's, a retired one) or that fails its tag is a miss. With ``reload``
    (a keys file's `KeysFile.changed`) a rotation of the file is taken while running.

    Streamed in pieces into buffers made once (`open_into` decrypts a raw payload straight into its L1
    slot): one-shot AES-GCM allocates its output per chunk and ran at a fifth of the streamed rate here."""

    def __init__(self, keys: dict[int, bytes], active: int,
                 reload: Callable[[], tuple[dict[int, bytes], int] | None] | None = None) -> None:
        self._state = self._checked(keys, active)     # (active id, AES by id): swapped whole, read once per chunk
        self._scratch = threading.local()      # each codec thread's plaintext buffer, kept across chunks
        self._reload = reload
        self._next_check = time.monotonic() + KEYS_CHECK_S

    @staticmethod
    def _checked(keys: dict[int, bytes], active: int) -> tuple[int, dict[int, object]]:
        from cryptography.hazmat.primitives.ciphers import algorithms

        for key_id, key in keys.items():
            if not 0 < key_id < 1 << 32:
                raise ValueError(f"key id {key_id} is out of range (1 to 2^32 - 1)")
            if len(key) != 32:
                raise ValueError(f"key {key_id} has {len(key)} bytes; AES-256 takes 32")
        if active not in keys:
            raise ValueError(f"the active key id {active} is not among the keys ({', '.join(map(str, keys))})")
        return active, {key_id: algorithms.AES(key) for key_id, key in keys.items()}

    @property
    def active(self) -> int:
        return self._state[0]

    def use(self, keys: dict[int, bytes], active: int) -> None:
        """Seal with ``active`` and open with ``keys`` from the next chunk on (a rotation); chunks on their way
        finish under the keys they started with."""
        self._state = self._checked(keys, active)

    def _current(self) -> tuple[int, dict[int, object]]:
        """The key set, after taking a changed keys file (at most once per ``KEYS_CHECK_S``): a rotation
        reaches every process of an engine without a restart. A keys file that cannot be read now is a
        warning, and the keys in use stay."""
        if self._reload is not None and time.monotonic() >= self._next_check:
            self._next_check = time.monotonic() + KEYS_CHECK_S
            try:
                changed = self._reload()
                if changed is not None:
                    self.use(*changed)
            except (TierCacheError, ValueError) as err:
                _keys_log.warning("keys", "encryption keys unchanged: %s", err)
        return self._state

    @staticmethod
    def _associated(meta: ChunkMeta, codec_code: int, payload_len: int, key_id: int) -> bytes:
        return (_signed_fields(meta, codec_code, payload_len)
                + struct.pack(f"<I{len(meta.shape)}Q", key_id, *meta.shape))

    def seal(self, meta: ChunkMeta, codec_code: int, payload: Buffer,
             into: bytearray | None = None) -> tuple[int, memoryview]:
        """(key id, nonce | ciphertext | tag) of ``payload`` under the active key, written at the start of
        ``into`` (at least ``SEAL_OVERHEAD`` bytes longer than the payload; None: a new buffer)."""
        from cryptography.hazmat.primitives.ciphers import Cipher, modes

        view = memoryview(payload).cast("B")
        n = len(view)
        sealed_len = NONCE_BYTES + n + TAG_BYTES
        out = memoryview(bytearray(sealed_len) if into is None else into)[:sealed_len]
        nonce = os.urandom(NONCE_BYTES)
        out[:NONCE_BYTES] = nonce
        active, aes = self._current()
        cipher = Cipher(aes[active], modes.GCM(nonce)).encryptor()
        cipher.authenticate_additional_data(self._associated(meta, codec_code, sealed_len, active))
        body = out[NONCE_BYTES:]
        _stream(cipher, view, body)
        cipher.finalize()
        body[n:] = cipher.tag
        return active, out

    def open_into(self, parsed: "ParsedHeader", payload: Buffer, out: memoryview | None = None) -> memoryview:
        """Decrypt a sealed payload into ``out`` (None: this thread's scratch) and return the plaintext's view
        there; `SignatureError` when its key is not here or it fails its tag (``out`` then holds garbage that
        nobody may use)."""
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers import Cipher, modes

        meta, codec_code, _, payload_len, key_id = parsed
        view = memoryview(payload).cast("B")
        aes = self._current()[1].get(key_id)
        if aes is None:
            raise SignatureError(f"chunk {meta.key.hex()[:16]}… is encrypted under key {key_id}, which is not "
                                 "here (another tenant's, or retired)")
        if len(view) != payload_len or payload_len < SEAL_OVERHEAD:
            raise TruncatedChunkError(f"sealed payload is {len(view)} bytes, header says {payload_len}")
        n = payload_len - SEAL_OVERHEAD
        if out is None:
            scratch = getattr(self._scratch, "buf", None)
            if scratch is None or len(scratch) < n:
                scratch = self._scratch.buf = bytearray(n)
            out = memoryview(scratch)
        plain = out.cast("B")[:n]
        cipher = Cipher(aes, modes.GCM(bytes(view[:NONCE_BYTES]))).decryptor()
        cipher.authenticate_additional_data(self._associated(meta, codec_code, payload_len, key_id))
        _stream(cipher, view[NONCE_BYTES:NONCE_BYTES + n], plain)
        try:
            cipher.finalize_with_tag(bytes(view[NONCE_BYTES + n:]))
        except InvalidTag:
            raise SignatureError(f"chunk {meta.key.hex()[:16]}… does not decrypt under key {key_id}: altered, "
                                 "or another tenant's") from None
        return plain


def _stream(cipher, src: memoryview, dst: memoryview) -> None:
    """``cipher`` over ``src`` into ``dst`` (as long), a piece at a time. ``update_into`` wants 15 bytes of
    room past each piece's output; the last 16 bytes, where ``dst`` may have none, go through ``update``."""
    n = len(src)
    bulk = max(n - 16, 0) if len(dst) - n < 15 else n
    for off in range(0, bulk, SEAL_PIECE):
        end = min(off + SEAL_PIECE, bulk)
        cipher.update_into(src[off:end], dst[off:end + 15])
    if bulk < n:
        dst[bulk:n] = cipher.update(src[bulk:n])


ChunkKeys = ChunkSigner | ChunkSealer     # a tenant's keys for its chunks: signed, or sealed


def payload_sum(parsed: "ParsedHeader", signer: ChunkKeys | None):
    """The running sum that checks a payload against its header: the header's checksum, or — for a signed
    chunk — the MAC of ``signer``; None for a sealed chunk where ``signer`` is the sealer (its tag checks it
    as it is opened: `ChunkSealer.open`). `SignatureError` for a keyed chunk with no key here to check it,
    and for an unkeyed one where chunks must be signed or sealed (a planted chunk with a valid checksum is
    refused here)."""
    meta, codec_code, checksum_code, payload_len, _ = parsed
    if checksum_code == SEALED:
        if not isinstance(signer, ChunkSealer):
            raise SignatureError(f"chunk {meta.key.hex()[:16]}… is encrypted, and there is no key here to open it")
        return None
    if checksum_code == SIGNED:
        if not isinstance(signer, ChunkSigner):
            raise SignatureError(f"chunk {meta.key.hex()[:16]}… is signed, and there is no key here to check it")
        return signer.running(meta, codec_code, payload_len)
    if signer is not None:
        what = "encrypted" if isinstance(signer, ChunkSealer) else "signed"
        raise SignatureError(f"chunk {meta.key.hex()[:16]}… is not {what}, and chunks here must be")
    return checksum_by_code(checksum_code)().running()


class ChunkFormat:
    """Encodes and verifies chunks with one configured codec and checksum (or signature). A chunk the codec
    does not apply to (8-bit KV under a quantizing codec) is stored raw, and its header says so."""

    def __init__(self, codec: str = "raw", checksum: str = "xxh3_64", signer: ChunkKeys | None = None) -> None:
        self.codec = codecs.get(codec)()
        self.raw = codecs.get("raw")()
        self.checksum = checksums.get(checksum)()
        self.signer = signer

    def codec_for(self, layout: ChunkLayout):
        return self.codec if self.codec.accepts(layout) else self.raw

    def max_stored_len(self, layout: ChunkLayout) -> int:
        """Bytes a stored chunk of this layout takes at most, header included."""
        sealing = SEAL_OVERHEAD if isinstance(self.signer, ChunkSealer) else 0
        return HEADER_BYTES + self.codec_for(layout).max_encoded_len(layout) + sealing

    @property
    def sealed(self) -> bool:
        return isinstance(self.signer, ChunkSealer)

    def encode_parts(self, meta: ChunkMeta, raw: Buffer) -> tuple[bytes, Buffer]:
        """Header and payload as two buffers, for writers that can write both without joining."""
        codec, job = self.encode_job(meta, raw, 1)
        return self.seal(meta, codec, job.run())

    def encode_job(self, meta: ChunkMeta, raw: Buffer, parts: int) -> tuple[Codec, EncodeJob]:
        """The codec this chunk is stored with, and its encode cut into up to ``parts`` steps (`encode_job`);
        `header` seals the payload the job finishes with."""
        raw_view = memoryview(raw).cast("B")
        if len(raw_view) != meta.raw_len:
            raise ValueError(
                f"chunk data is {len(raw_view)} bytes, meta {meta.shape} {meta.dtype} needs {meta.raw_len}"
            )
        codec = self.codec_for(meta.layout)
        return codec, encode_job(codec, raw_view, meta.layout, parts)

    def sealed_len(self, payload: Buffer) -> int:
        """Bytes ``payload`` takes once sealed (`seal` writes it into a buffer this long)."""
        return len(memoryview(payload).cast("B")) + SEAL_OVERHEAD

    def seal(self, meta: ChunkMeta, codec: Codec, payload: Buffer,
             into: bytearray | None = None) -> tuple[bytes, Buffer]:
        """The stored form of ``payload`` (``codec``'s encoding of the chunk): its header — checksum, signature
        or key id, and the rest — and the payload as stored (encrypted under a sealer, into ``into`` when
        given: see `ChunkSealer.seal`)."""
        shape = tuple(meta.shape) + (0,) * (MAX_DIMS - len(meta.shape))
        if isinstance(self.signer, ChunkSealer):
            code = SEALED
            total, payload = self.signer.seal(meta, codec.code, payload, into)
        elif self.signer is not None:
            code, total = SIGNED, self.signer.sign(meta, codec.code, payload)
        else:
            code, total = self.checksum.code, self.checksum(payload)
        body = _BODY.pack(
            MAGIC, VERSION, HEADER_BYTES, codec.code, code, DTYPE_CODES[meta.dtype],
            len(meta.shape), meta.namespace, meta.key, meta.parent or NO_PARENT, meta.stored_at, meta.num_tokens,
            meta.raw_len, len(payload), total, *shape,
        )
        return body + _CRC.pack(zlib.crc32(body)), payload

    def encode(self, meta: ChunkMeta, raw: Buffer) -> bytes:
        header, payload = self.encode_parts(meta, raw)
        return header + bytes(payload) if isinstance(payload, memoryview) else header + payload


PARENT_AT = struct.calcsize(f"<4sHHBBBB{NAMESPACE_DIGEST_BYTES}s{HASH_BYTES}s")   # where a header keeps the parent


def header_parent(header: Buffer) -> BlockHash | None:
    """The parent key a header checked before names (None: the first chunk of its request)."""
    parent = bytes(memoryview(header).cast("B")[PARENT_AT:PARENT_AT + HASH_BYTES])
    return None if parent == NO_PARENT else BlockHash(parent)


def read_header(blob: Buffer) -> ParsedHeader:
    """Parse and check the header alone: (meta, codec code, checksum code, payload length, payload checksum)."""
    view = memoryview(blob).cast("B")
    if len(view) < HEADER_BYTES:
        raise TruncatedChunkError(f"chunk is {len(view)} bytes, shorter than its {HEADER_BYTES}-byte header")
    body = view[:_BODY.size]
    (crc,) = _CRC.unpack_from(view, _BODY.size)
    if zlib.crc32(body) != crc:
        raise CorruptHeaderError("header checksum mismatch")
    (magic, version, header_len, codec, checksum, dtype, ndim, namespace, key, parent, stored_at, num_tokens,
     raw_len, payload_len, payload_sum, *shape) = _BODY.unpack(body)
    if magic != MAGIC:
        raise CorruptHeaderError(f"bad magic {magic!r}")
    if version != VERSION or header_len != HEADER_BYTES:
        raise CorruptHeaderError(f"unsupported format version {version} (header {header_len} bytes)")
    if dtype not in DTYPE_NAMES or ndim > MAX_DIMS:
        raise CorruptHeaderError(f"bad dtype code {dtype} or ndim {ndim}")
    meta = ChunkMeta(namespace, BlockHash(key), num_tokens, DTYPE_NAMES[dtype], tuple(shape[:ndim]),
                     None if parent == NO_PARENT else BlockHash(parent), stored_at)
    if meta.raw_len != raw_len:
        raise CorruptHeaderError(f"raw length {raw_len} disagrees with shape {meta.shape} {meta.dtype}")
    return meta, codec, checksum, payload_len, payload_sum


def check_header(header: Buffer, namespace: bytes | None, key: bytes | None) -> ParsedHeader:
    """`read_header` plus the namespace and key checks."""
    parsed = read_header(header)
    meta = parsed[0]
    if namespace is not None and meta.namespace != namespace:
        raise NamespaceMismatchError(f"chunk namespace {meta.namespace.hex()} is not {namespace.hex()}")
    if key is not None and meta.key != key:
        raise KeyMismatchError(f"chunk key {meta.key.hex()[:16]}… is not {bytes(key).hex()[:16]}…")
    return parsed


def check_payload(parsed: ParsedHeader, payload: Buffer, signer: ChunkKeys | None = None) -> None:
    """Check a payload's length and checksum (or signature, or — for a sealed one — that it opens) against its
    parsed header, without decoding it."""
    meta, payload_len, expected = parsed[0], parsed[3], parsed[4]
    if len(memoryview(payload).cast("B")) != payload_len:
        raise TruncatedChunkError(f"payload is {len(memoryview(payload))} bytes, header says {payload_len}")
    running = payload_sum(parsed, signer)
    if running is None:
        signer.open_into(parsed, payload)
        return
    running.update(payload)
    if running.intdigest() != expected:
        what = "signature" if parsed[2] == SIGNED else "checksum"
        raise (SignatureError if parsed[2] == SIGNED else ChecksumMismatchError)(
            f"payload {what} mismatch for chunk {meta.key.hex()[:16]}…")


def verify_payload_into(parsed: ParsedHeader, payload: Buffer, out: memoryview,
                        signer: ChunkKeys | None = None) -> None:
    """Check a payload against its parsed header (a sealed one: open it) and decode it into ``out`` (at least
    its raw length)."""
    meta, codec_code = parsed[0], parsed[1]
    if parsed[2] == SEALED:
        payload_sum(parsed, signer)                    # the sealer is here, or a SignatureError
        if codec_code == 0 and parsed[3] - SEAL_OVERHEAD == meta.raw_len:
            signer.open_into(parsed, payload, out)     # raw: decrypted straight into place
            return
        payload = signer.open_into(parsed, payload)    # into this thread's scratch, decoded from there
    else:
        check_payload(parsed, payload, signer)
    decoder(codec_code).decode_into(memoryview(payload).cast("B"), meta.layout, out)


def decode(blob: Buffer, namespace: bytes | None = None, key: bytes | None = None,
           signer: ChunkKeys | None = None) -> DecodedChunk:
    """Verify a stored chunk and return its raw bytes; raises a `ChunkFormatError` on any mismatch."""
    parsed = check_header(blob, namespace, key)
    data = bytearray(parsed[0].raw_len)
    verify_payload_into(parsed, memoryview(blob).cast("B")[HEADER_BYTES:], memoryview(data), signer)
    return DecodedChunk(parsed[0], data)
