"""The reference engine with quantized tiers (``format.codec`` int8 / fp8-e4m3): chunks come back from disk
and from a real `tiercache serve` at half the bytes; raw and quantized deployments sharing one disk path
or one server never serve each other's chunks; a damaged quantized file is a miss."""
import pytest

from tests.support.engine_runs import assert_back_to_baseline, offload, run_sequential, shared_prompts
from tiercache.engine import EngineConfig, LLMEngine, ModelConfig

PROMPTS = shared_prompts(n=3)
MODEL = ModelConfig(dtype="bfloat16")


def engine(codec: str, **tiers) -> LLMEngine:
    return LLMEngine(model_cfg=MODEL, engine_cfg=EngineConfig(enable_prefix_caching=False),
                     offload=offload(format={"codec": codec}, **tiers))


def disk(path) -> dict:
    return {"disk": {"enabled": True, "path": str(path)}}


def run(codec: str, prompts=PROMPTS, **tiers):
    """One engine, the prompts in turn: (outputs, the first request's hit tokens, the connector's tier stats)."""
    with engine(codec, **tiers) as e:
        seqs = run_sequential(e, prompts)
        stats = e.stats()["connector"]["tiers"]
        assert_back_to_baseline(e)
        return [s.output_token_ids for s in seqs], seqs[0].metrics.external_hit_tokens, stats


@pytest.mark.parametrize("codec", ["int8", "fp8-e4m3"])
def test_a_restarted_engine_hits_quantized_chunks_on_disk_at_half_the_bytes(tmp_path, codec):
    run(codec, **disk(tmp_path / codec))
    _, hit, stats = run(codec, **disk(tmp_path / codec))
    assert hit == 192 and stats["disk"]["loaded"] >= 3 and stats["disk"]["integrity_failures"] == 0
    run("raw", **disk(tmp_path / "raw"))
    files = {d: sorted(f.stat().st_size for f in (tmp_path / d).rglob("*.chunk")) for d in (codec, "raw")}
    assert len(files[codec]) == len(files["raw"]) >= 3
    assert all(q < 0.55 * r for q, r in zip(files[codec], files["raw"]))


def test_raw_and_quantized_deployments_on_one_disk_path_never_read_each_other(tmp_path):
    expect, _, _ = run("raw")                                 # no tiers below L1: the exact outputs
    run("raw", **disk(tmp_path))
    _, hit, stats = run("int8", **disk(tmp_path))             # the raw chunks are not its own
    assert hit == 0 and stats["disk"]["loaded"] == 0 and stats["disk"]["integrity_failures"] == 0
    outputs, hit, stats = run("raw", **disk(tmp_path))        # and the quantized ones are not raw's
    assert outputs == expect and hit == 192 and stats["disk"]["integrity_failures"] == 0
    _, hit, _ = run("fp8-e4m3", **disk(tmp_path))             # nor one lossy codec's another's
    assert hit == 0
    assert len({f.relative_to(tmp_path).parts[0] for f in tmp_path.rglob("*.chunk")}) == 3   # one directory each


def test_raw_and_quantized_engines_sharing_one_server_never_read_each_other(cache_server):
    remote = {"grpc": {"enabled": True, "address": cache_server.address}}
    run("int8", **remote)
    _, hit, stats = run("raw", **remote)
    assert hit == 0 and stats["grpc"]["loaded"] == 0 and stats["grpc"]["integrity_failures"] == 0
    _, hit, stats = run("int8", **remote)
    assert hit == 192 and stats["grpc"]["loaded"] >= 3


def test_a_damaged_quantized_file_is_a_miss(tmp_path):
    expect, _, _ = run("int8", **disk(tmp_path))
    for f in tmp_path.rglob("*.chunk"):
        raw = bytearray(f.read_bytes())
        raw[-3] ^= 0x10                                        # inside the scales
        f.write_bytes(raw)
    outputs, hit, stats = run("int8", **disk(tmp_path))
    assert hit == 0 and stats["disk"]["loaded"] == 0 and stats["disk"]["integrity_failures"] >= 1
    assert outputs == expect                                  # recomputed, as the first run computed them


def test_the_disk_link_counts_the_bytes_a_quantized_chunk_takes(tmp_path):
    """A link's rate limits and statistics pace what crosses it: the stored (quantized) bytes, not the raw."""
    with engine("int8", disk={"enabled": True, "path": str(tmp_path), "write_mode": "write-through"}) as e:
        run_sequential(e, PROMPTS[:1])
        e.connector.drain()
        sent = e.stats()["connector"]["transfers"]["host_disk"]["routes"]["cpu→disk"]["bytes"]
        on_disk = sum(f.stat().st_size for f in tmp_path.rglob("*.chunk"))
        raw = e.stats()["connector"]["transfers"]["device_host"]["routes"]["device→cpu"]["bytes"]
    assert sent == on_disk and 0 < on_disk < 0.55 * raw
