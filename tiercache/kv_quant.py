"""KV quantization codecs: INT8 and FP8 (e4m3) with one scale per small group of values.

Worker side, inside transfer handlers: a chunk is encoded on its way from L1
down to disk or a remote tier, and decoded straight into its L1 slot when it
comes back up, so L0 and L1 hold the engine's own dtype and only the tiers
below hold 8-bit codes. Both codecs are lossy: opt-in (``format.codec``), named
in the storage digest (`tiercache.contracts.keys.Namespace.storage_digest`), and
their size, speed and accuracy are what ``tiercache bench codecs`` reports.

Payload: one code byte per value, in the chunk's own order, then one bf16
scale per group of `group_size` consecutive values along the innermost axis —
a token's head vector in tiercache's pool (``[..., heads, head_dim]``), a run
of a block row in an engine's tensors. A value decodes to ``code × scale``.
Scales are rounded up to bf16 so that no code leaves its format's range:

- ``int8``: ``code = round(x / scale)``, ``scale ≥ amax / 127``; error ≤ scale / 2
  (≤ 0.4 % of the group's largest magnitude).
- ``fp8-e4m3``: ``code = fp8(x / scale)``, ``scale ≥ amax / 448``; error ≤ 2⁻⁴ of
  ``|x|``, or ``scale · 2⁻¹⁰`` for values in fp8's subnormal range.

8-bit KV (an engine already running FP8 KV) is stored raw. Inf or nan in a
chunk is refused with `NonFiniteKVError` (the store fails; nothing is stored).
The work is a few torch ops over cache-sized pieces of the chunk (no per-token
Python), in per-thread scratch reused across chunks; payloads are encoded into
recycled buffers, and decoding writes into the destination buffer.
"""
from __future__ import annotations

import functools
import sys
import threading
from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from tiercache.arith import ceil_div
from tiercache.codecs import Buffer, EncodeJob
from tiercache.contracts.layout import ChunkLayout
from tiercache.errors import CodecError, NonFiniteKVError

GROUP = 64                 # values per scale where the innermost axis allows: 2 B of scale per 64 B of codes
PIECE = 1 << 20            # values per step: fewer torch calls per chunk; larger pieces fall out of cache
_SCALE_BYTES = 2           # bf16
_ROUND_UP = 1 + 2 ** -7    # bf16 rounds to nearest within 2⁻⁸: scale × this, rounded, is ≥ the exact scale
_MIN_SCALE = 2.0 ** -126   # a normal float32: 1 / scale stays finite (all-zero groups get this one)
_FLOAT32_MAX = torch.finfo(torch.float32).max
_FLOAT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MIN_GROUP = 16             # below this many values per scale, scales cost more than they are worth: raw
# per float dtype: the same-width integer view and the mask that drops the sign bit (as integers, float
# magnitudes order like their bit patterns, inf and nan above every finite one: amax is an integer amax)
_BITS = {"float32": (torch.int32, 0x7FFFFFFF), "bfloat16": (torch.int16, 0x7FFF), "float16": (torch.int16, 0x7FFF)}


@functools.lru_cache(maxsize=64)
def group_size(inner: int) -> int:
    """Values per scale for an innermost axis of ``inner`` values: `GROUP`, or the largest divisor of
    ``inner`` below it (32 for a 32-wide head)."""
    for g in range(min(inner, GROUP), 0, -1):
        if inner % g == 0:
            return g
    return 1


def _tensor(buf: Buffer, dtype: torch.dtype) -> torch.Tensor:
    view = memoryview(buf).cast("B")
    if view.readonly:                 # bytes (tests, benchmarks): torch only wraps writable memory
        view = memoryview(bytearray(view))
    return torch.frombuffer(view, dtype=torch.uint8).view(dtype)


class _Scratch(threading.local):
    """One thread's working memory: a piece's scratch (on the threads that encode and decode pieces), and
    the buffers the payloads it started went into (on the thread that starts encodes: a writer's, or the
    codec thread itself). A writer holds a payload until it has sent it, so a payload buffer is handed out
    again only once nothing references it any more (fresh memory for every chunk would pay a page fault per
    4 KiB); a writer holding more than a few at once gets fresh ones beyond those kept."""
    MAX_PAYLOADS = 4

    def __init__(self) -> None:
        self.payloads: list[bytearray] = []

    @functools.cached_property
    def work(self) -> torch.Tensor:
        return torch.empty(PIECE, dtype=torch.float32)

    @functools.cached_property
    def bits(self) -> torch.Tensor:
        return torch.empty(PIECE, dtype=torch.int32)

    def payload(self, nbytes: int) -> memoryview:
        for i in range(len(self.payloads)):
            if sys.getrefcount(self.payloads[i]) == 2:      # this list and the call's argument: no views left
                if len(self.payloads[i]) < nbytes:
                    self.payloads[i] = bytearray(nbytes)
                return memoryview(self.payloads[i])[:nbytes]
        buf = bytearray(nbytes)
        if len(self.payloads) < self.MAX_PAYLOADS:
            self.payloads.append(buf)
        return memoryview(buf)[:nbytes]


class _GroupQuantCodec(ABC):
    """Shared by both formats: layout checks, scales, the piece loop. Subclasses map scaled values to
    codes and back."""
    name: ClassVar[str]
    code: ClassVar[int]
    lossy: ClassVar[bool] = True
    qmax: ClassVar[float]
    code_factor: ClassVar[float] = 1.0    # `_from_codes` yields code / code_factor

    def __init__(self) -> None:
        self._scratch = _Scratch()

    def accepts(self, layout: ChunkLayout) -> bool:
        return layout.dtype in _FLOAT and bool(layout.shape) and group_size(layout.shape[-1]) >= MIN_GROUP

    def max_encoded_len(self, layout: ChunkLayout) -> int:
        if not self.accepts(layout):
            return layout.raw_len
        return layout.numel + layout.numel // group_size(layout.shape[-1]) * _SCALE_BYTES

    def encode(self, raw: memoryview, layout: ChunkLayout) -> Buffer:
        return self.encode_job(raw, layout, 1).run()

    def encode_job(self, raw: memoryview, layout: ChunkLayout, parts: int) -> EncodeJob:
        """The encode as up to ``parts`` steps over disjoint runs of whole pieces, each writing its own codes
        and scales into one payload (the same bytes as one step makes); ``finish`` checks every scale."""
        n, g = layout.numel, group_size(layout.shape[-1])
        payload = self._scratch.payload(self.max_encoded_len(layout))
        if n == 0:
            return EncodeJob((), lambda: payload)
        src = _tensor(raw, _FLOAT[layout.dtype])
        out = torch.frombuffer(payload, dtype=torch.uint8)
        codes, scales = out[:n], out[n:].view(torch.bfloat16)
        step = max(g, PIECE // g * g)
        pieces = ceil_div(n, step)
        cuts = [min(n, pieces * i // parts * step) for i in range(parts + 1)]
        bits = _BITS[layout.dtype]
        steps = tuple(functools.partial(self._encode_range, src, codes, scales, bits, g, step, a, b)
                      for a, b in zip(cuts, cuts[1:]) if a < b)

        def finish() -> Buffer:
            if not bool(torch.isfinite(scales).all()):
                raise NonFiniteKVError(f"chunk of {layout.dtype} {layout.shape} holds inf or nan KV; "
                                       f"{self.name} cannot store it")
            return payload
        return EncodeJob(steps, finish)

    def _encode_range(self, src: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                      bits: tuple[torch.dtype, int], g: int, step: int, first: int, last: int) -> None:
        """Codes and scales of values ``first .. last`` (whole groups), a piece at a time in this thread's scratch;
        ``bits``: the source dtype's same-width integer view and the mask that drops its sign (`_BITS`)."""
        scratch = self._scratch
        int_dtype, abs_mask = bits
        for start in range(first, last, step):
            end = min(last, start + step)
            x, k = src[start:end], end - start
            magnitude = scratch.bits.view(int_dtype)[:k]
            torch.bitwise_and(x.view(int_dtype), abs_mask, out=magnitude)
            amax = magnitude.view(-1, g).amax(1).view(x.dtype).float()     # inf or nan where a group has one
            scale = torch.clamp_min(amax * (_ROUND_UP / self.qmax), _MIN_SCALE).to(torch.bfloat16)
            scales[start // g:end // g] = scale
            work = scratch.work[:k]
            work.copy_(x)
            work.view(-1, g).mul_(scale.float().reciprocal_().unsqueeze(1))
            self._to_codes(work, codes[start:end])

    def decode_into(self, payload: memoryview, layout: ChunkLayout, out: memoryview) -> None:
        n, g = layout.numel, group_size(layout.shape[-1])
        if not self.accepts(layout):
            raise CodecError(f"{self.name} payload for a {layout.dtype} chunk (it stores only float KV)")
        if len(payload) != self.max_encoded_len(layout):
            raise CodecError(f"{self.name} payload is {len(payload)} bytes, a {layout.dtype} {layout.shape} "
                             f"chunk takes {self.max_encoded_len(layout)}")
        if len(out) < layout.raw_len:
            raise CodecError(f"a {layout.raw_len}-byte chunk does not fit a {len(out)}-byte buffer")
        if n == 0:
            return
        data = _tensor(payload, torch.uint8)
        codes, scales = data[:n].view(torch.int8), data[n:].view(torch.bfloat16).float()
        if not bool(torch.isfinite(scales).all()) or not bool((scales > 0).all()):
            raise CodecError(f"{self.name} payload has scales that are not finite and positive")
        factor = self.code_factor
        if factor * float(scales.max()) < _FLOAT32_MAX:   # one multiply by (scale × factor), unless it overflows
            scales, factor = scales * factor, 1.0
        dst = torch.frombuffer(out, dtype=torch.uint8)[:layout.raw_len].view(_FLOAT[layout.dtype])
        scratch, step = self._scratch, max(g, PIECE // g * g)
        for start in range(0, n, step):
            end = min(n, start + step)
            work = self._from_codes(codes[start:end], scratch)
            if factor != 1.0:
                work.mul_(factor)
            work.view(-1, g).mul_(scales[start // g:end // g].unsqueeze(1))
            dst[start:end].copy_(work)

    # -- per format -----------------------------------------------------------------------------------
    @abstractmethod
    def _to_codes(self, scaled: torch.Tensor, codes: torch.Tensor) -> None:
        """Write the codes of ``scaled`` (values within ±qmax) into ``codes``."""

    @abstractmethod
    def _from_codes(self, codes: torch.Tensor, scratch: _Scratch) -> torch.Tensor:
        """The values of ``codes`` as float32 in scratch, divided by `code_factor`."""


class Int8Codec(_GroupQuantCodec):
    """Symmetric INT8: 255 levels per group, the most accurate of the two."""
    name = "int8"
    code = 3
    qmax = 127.0

    def _to_codes(self, scaled: torch.Tensor, codes: torch.Tensor) -> None:
        codes.view(torch.int8).copy_(scaled.round_())

    def _from_codes(self, codes: torch.Tensor, scratch: _Scratch) -> torch.Tensor:
        work = scratch.work[:codes.numel()]
        work.copy_(codes)
        return work


class Fp8E4M3Codec(_GroupQuantCodec):
    """FP8 e4m3 (the format of vLLM's ``--kv-cache-dtype fp8``), with a scale per group: relative
    precision across a group's whole range, where INT8's is even.

    Decoding moves the code's bits into a float32 (sign to bit 31; exponent and mantissa to bits 20–26):
    that float is the fp8 value × 2⁻¹²⁰ — fp8 subnormals included — so the 2¹²⁰ goes into the scale (or, for
    scales above 2⁸ that it would overflow, into a multiply of its own). torch's own fp8 → float conversion
    is scalar on CPU and runs at a fifth of the speed."""
    name = "fp8-e4m3"
    code = 4
    qmax = 448.0
    code_factor = 2.0 ** 120
    _SIGN_EXP_MANTISSA = -0x78100000     # 0x87F00000 as int32: bit 31 and bits 20–26

    def _to_codes(self, scaled: torch.Tensor, codes: torch.Tensor) -> None:
        codes.view(torch.float8_e4m3fn).copy_(scaled)

    def _from_codes(self, codes: torch.Tensor, scratch: _Scratch) -> torch.Tensor:
        bits = scratch.bits[:codes.numel()]
        bits.copy_(codes)                  # sign-extends: the sign lands in bit 31 and bits 7–30
        bits.bitwise_left_shift_(20).bitwise_and_(self._SIGN_EXP_MANTISSA)
        return bits.view(torch.float32)

