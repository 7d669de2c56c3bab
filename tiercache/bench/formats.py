"""A bench run's chunk format from its variant's name: a codec, sealed when it ends in ``+aes`` (``raw+aes``,
``lz4+aes``: AES-256-GCM under a key made for the run), so `bench tiers --codecs raw,raw+aes` measures what
encryption at rest costs beside the same tier without it, in one run."""
from __future__ import annotations

import atexit
import os
import tempfile

SEALED = "+aes"


def split_variant(variant: str) -> tuple[str, bool]:
    """(codec name, sealed)."""
    return (variant[:-len(SEALED)], True) if variant.endswith(SEALED) else (variant, False)


def format_section(variant: str) -> dict:
    """The ``format`` config section of a variant (a sealed one's keys file: a fresh key, this process's)."""
    codec, sealed = split_variant(variant)
    if not sealed:
        return {"codec": codec}
    fd, path = tempfile.mkstemp(prefix="tiercache-bench-", suffix=".keys")
    with os.fdopen(fd, "w") as f:
        f.write(f"1 {os.urandom(32).hex()} active\n")
    atexit.register(lambda: os.path.exists(path) and os.unlink(path))
    return {"codec": codec, "encryption_keys_file": path}
