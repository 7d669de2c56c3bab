"""Tokenizers: bytes by default, or a local ``tokenizer.json`` through the `tokenizers` library."""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

from tiercache.errors import ConfigError


class Tokenizer(Protocol):
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0–255; 256 is BOS, 257 EOS. Needs a vocabulary of at least 258."""
    BOS = 256
    EOS = 257

    def __init__(self, add_bos: bool = True) -> None:
        self.add_bos = add_bos
        self.eos_token_id: int | None = self.EOS

    def encode(self, text: str) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if self.add_bos else ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        try:
            self._tok = _Tokenizer.from_file(str(file))
        except Exception as err:  # the library raises plain Exceptions for unreadable files
            raise ConfigError("tokenizer", str(file), f"cannot load tokenizer: {err}") from None
        self.eos_token_id = None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)
