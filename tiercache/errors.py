"""Exceptions raised at tiercache's API edges.

Inside the transfer path these are caught and turned into failed results or
misses (docs/architecture.md); callers outside it see a specific type that names the
offending value.
"""
from __future__ import annotations


class TierCacheError(Exception):
    """Base of every error tiercache raises on purpose."""


class ConfigError(TierCacheError, ValueError):
    """A configuration value or command-line flag is invalid; the message names it (and the value, if any)."""

    def __init__(self, field: str, value: object, reason: str) -> None:
        what = f"flag {field}" if field.startswith("-") else f"config field {field!r}"
        got = "" if value is None else f" (got {value!r})"
        super().__init__(f"{what}: {reason}{got}")
        self.field = field
        self.value = value
        self.reason = reason


class RegistryError(TierCacheError, KeyError):
    """A registry has no entry under the requested name."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the sentence readable
        return str(self.args[0])


class ChunkFormatError(TierCacheError):
    """A stored chunk failed verification; callers treat it as a miss."""


class CorruptHeaderError(ChunkFormatError):
    """The header's magic, version, length or own checksum is wrong."""


class NamespaceMismatchError(ChunkFormatError):
    """The chunk belongs to another model, layout or tenant."""


class KeyMismatchError(ChunkFormatError):
    """The chunk was stored under a different key than the one requested."""


class TruncatedChunkError(ChunkFormatError):
    """The payload is shorter or longer than the header says."""


class ChecksumMismatchError(ChunkFormatError):
    """The payload's checksum does not match the header."""


class SignatureError(ChunkFormatError):
    """A chunk's signature is missing where chunks must be signed, or does not verify with this key."""


class CodecError(ChunkFormatError):
    """The payload could not be decoded by its codec."""


class NonFiniteKVError(TierCacheError, ValueError):
    """A chunk to be quantized holds inf or nan: it is not stored (a raw chunk would keep them as they are)."""
