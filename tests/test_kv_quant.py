"""KV quantization codecs (int8, fp8-e4m3): round trips within their stated error bounds on random and
adversarial KV, inf/nan refused, 8-bit KV kept raw, damaged payloads refused, and quantized chunks filed
apart from raw ones."""
import numpy as np
import pytest
import torch

from tiercache.build import lossy_codec
from tiercache.codecs import codecs
from tiercache.config import TierCacheConfig
from tiercache.contracts.keys import KVGeometry, KVShard, Namespace
from tiercache.contracts.layout import ChunkLayout
from tiercache.errors import ChecksumMismatchError, CodecError, NonFiniteKVError
from tiercache.kv_quant import group_size
from tiercache.wire.chunk_format import HEADER_BYTES, ChunkFormat, ChunkMeta, decode, read_header

NS, KEY = b"N" * 16, b"K" * 32
SHAPE = (2, 2, 2, 16, 2, 64)               # layers, k/v, blocks, tokens, heads, head_dim
QUANTIZED = ["int8", "fp8-e4m3"]
DTYPES = {"bfloat16": 2 ** -8, "float16": 2 ** -11, "float32": 0.0}    # relative rounding of the output dtype


def round_trip(codec: str, x: torch.Tensor) -> torch.Tensor:
    dtype = str(x.dtype).removeprefix("torch.")
    meta = ChunkMeta(NS, KEY, 32, dtype, tuple(x.shape))
    blob = ChunkFormat(codec).encode(meta, x.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    data = decode(blob, NS, KEY).data
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(x.dtype).view(x.shape)


def assert_within_bound(codec: str, x: torch.Tensor, y: torch.Tensor) -> None:
    """The module's stated bound per value, plus the output dtype's own rounding."""
    g = group_size(x.shape[-1])
    xf, yf = x.double().view(-1, g), y.double().view(-1, g)
    amax = xf.abs().amax(1, keepdim=True)
    if codec == "int8":
        bound = amax / 127 * (1 + 2 ** -7) * (1 + 2 ** -8) / 2
    else:
        bound = xf.abs() * 2 ** -4 + amax / 448 * (1 + 2 ** -6) * 2 ** -10
    bound = bound + (xf.abs() + bound) * DTYPES[str(x.dtype).removeprefix("torch.")] + 1e-300
    assert bool(((yf - xf).abs() <= bound).all()), float(((yf - xf).abs() / bound).max())


@pytest.mark.parametrize("codec", QUANTIZED)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_random_kv_round_trips_within_the_bound(codec, dtype):
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1)).to(getattr(torch, dtype))
    y = round_trip(codec, x)
    assert_within_bound(codec, x, y)
    rel = float((y.double() - x.double()).norm() / x.double().norm())
    assert rel < (0.01 if codec == "int8" else 0.04)


def adversarial(dtype: torch.dtype) -> torch.Tensor:
    """Outliers beside small values, all-zero groups, one-signed groups, tiny and (for fp32) huge values."""
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(2)) * 0.01
    x[0, 0, 0, :, :, 3] = 300.0                       # an outlier channel in every token of one block
    x[0, 1, 1, 5, 1, :] = 0.0                         # a zero head vector
    x[1, 0, 0, 2, 0, :] = -torch.rand(64) - 1         # negative only
    x[1, 1, 1, 7, 1, :] = 1e-30 if dtype == torch.float32 else 1e-6
    if dtype == torch.float32:
        x[1, 1, 0, 0, 0, :] = torch.linspace(-1, 1, 64) * 3e38
    return x.to(dtype)


@pytest.mark.parametrize("codec", QUANTIZED)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_adversarial_kv_round_trips_within_the_bound(codec, dtype):
    x = adversarial(getattr(torch, dtype))
    y = round_trip(codec, x)
    assert_within_bound(codec, x, y)
    assert bool((y[0, 1, 1, 5, 1] == 0).all())        # zeros stay zeros


@pytest.mark.parametrize("codec", QUANTIZED)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_inf_and_nan_are_refused_with_a_clear_error(codec, bad):
    x = torch.randn(SHAPE).to(torch.bfloat16)
    x[1, 1, 1, 15, 1, 63] = bad
    meta = ChunkMeta(NS, KEY, 32, "bfloat16", SHAPE)
    with pytest.raises(NonFiniteKVError, match="inf or nan"):
        ChunkFormat(codec).encode(meta, x.view(-1).view(torch.uint8).numpy().tobytes())


@pytest.mark.parametrize("codec", QUANTIZED)
def test_8_bit_kv_is_stored_raw(codec):
    x = torch.randn(SHAPE).to(torch.float8_e4m3fn)
    raw = x.view(-1).view(torch.uint8).numpy().tobytes()
    blob = ChunkFormat(codec).encode(ChunkMeta(NS, KEY, 32, "float8_e4m3fn", SHAPE), raw)
    assert read_header(blob)[1] == codecs.get("raw").code and bytes(decode(blob, NS, KEY).data) == raw


@pytest.mark.parametrize("codec", QUANTIZED)
def test_a_narrow_innermost_axis_is_stored_raw(codec):
    """Eight values per scale would cost a quarter of the codes in scales: not worth it, so raw."""
    x = torch.randn((2, 2, 1, 16, 2, 8)).to(torch.bfloat16)
    blob = ChunkFormat(codec).encode(ChunkMeta(NS, KEY, 16, "bfloat16", tuple(x.shape)),
                                     x.view(-1).view(torch.uint8).numpy().tobytes())
    assert read_header(blob)[1] == codecs.get("raw").code


@pytest.mark.parametrize("codec", QUANTIZED)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bf16_kv_takes_at_most_053_of_its_raw_bytes(codec, head_dim):
    layout = ChunkLayout("bfloat16", (32, 2, 16, 16, 8, head_dim))
    assert ChunkFormat(codec).max_stored_len(layout) <= 0.53 * layout.raw_len


@pytest.mark.parametrize("codec", QUANTIZED)
def test_a_damaged_payload_is_refused(codec):
    x = torch.randn(SHAPE).to(torch.bfloat16)
    meta = ChunkMeta(NS, KEY, 32, "bfloat16", SHAPE)
    blob = bytearray(ChunkFormat(codec).encode(meta, x.view(-1).view(torch.uint8).numpy().tobytes()))
    flipped = bytearray(blob)
    flipped[HEADER_BYTES + 100] ^= 0x40
    with pytest.raises(ChecksumMismatchError):
        decode(flipped, NS, KEY)
    # a scale forged to nan, under a checksum that matches (a writer that lies): refused by the codec
    payload = bytearray(blob[HEADER_BYTES:])
    payload[-2:] = torch.tensor([float("nan")], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()

    class Forger(codecs.get(codec)):                  # the codec, but its payload is the forged one
        def encode(self, raw, layout):
            return bytes(payload)

    forged = ChunkFormat(codec, checksum="crc32")
    forged.codec = Forger()
    with pytest.raises(CodecError, match="scales"):
        decode(forged.encode(meta, x.view(-1).view(torch.uint8).numpy().tobytes()), NS, KEY)


def test_payload_buffers_are_recycled_only_once_released():
    codec = codecs.get("int8")()
    layout = ChunkLayout("float32", SHAPE)
    a = torch.randn(SHAPE)
    b = torch.randn(SHAPE)
    first = codec.encode(memoryview(a.view(-1).view(torch.uint8).numpy()), layout)
    kept = bytes(first)
    second = codec.encode(memoryview(b.view(-1).view(torch.uint8).numpy()), layout)
    assert bytes(first) == kept and bytes(second) != kept      # a held payload is never written over
    address = np.frombuffer(first, np.uint8).ctypes.data
    del first
    third = codec.encode(memoryview(b.view(-1).view(torch.uint8).numpy()), layout)
    assert np.frombuffer(third, np.uint8).ctypes.data == address and bytes(third) == bytes(second)


def test_a_lossy_codec_files_chunks_apart_and_a_lossless_one_does_not():
    ns = Namespace("m", KVGeometry(2, 2, 64, "bfloat16"), 16)
    digests = {name: ns.storage_digest(64, KVShard(), lossy_codec(TierCacheConfig().replace(format={"codec": name})))
               for name in ("raw", "lz4", "int8", "fp8-e4m3")}
    assert digests["raw"] == digests["lz4"] == ns.storage_digest(64)
    assert len({digests["raw"], digests["int8"], digests["fp8-e4m3"]}) == 3


@pytest.mark.parametrize("codec", QUANTIZED)
def test_an_encode_cut_into_parts_makes_the_payload_of_one_whichever_thread_runs_each_part(codec):
    """`encode_job` cuts a chunk into runs of whole pieces (3M values: three 1M-value pieces, two parts);
    the parts, run on two threads in reverse order, make the same bytes as one encode, and an inf in the
    last part is refused when the job finishes."""
    import threading
    shape = (3, 2, 4, 64, 8, 128)
    x = torch.randn(shape).to(torch.bfloat16)
    layout = ChunkLayout("bfloat16", shape)
    one = codecs.get(codec)()
    whole = bytes(one.encode(memoryview(x.view(-1).view(torch.uint8).numpy()), layout))
    for bad in (False, True):
        if bad:
            x.view(-1)[-1] = float("inf")
        job = codecs.get(codec)().encode_job(memoryview(x.view(-1).view(torch.uint8).numpy()), layout, 2)
        assert len(job.steps) == 2
        runs = [threading.Thread(target=step) for step in reversed(job.steps)]
        for t in runs:
            t.start()
        for t in runs:
            t.join()
        if bad:
            with pytest.raises(NonFiniteKVError, match="inf or nan"):
                job.finish()
        else:
            assert bytes(job.finish()) == whole
