"""The reference engine over L1 + L2 files: restarts, corrupt files and full disks never change outputs."""
import errno
import os

from tests.support.engine_runs import assert_back_to_baseline, offload, run_sequential, shared_prompts
from tiercache.engine import EngineConfig, LLMEngine


def with_disk(path, **disk):
    return offload(disk={"enabled": True, "path": str(path), **disk})


def reference(prompts):
    with LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False)) as engine:
        return [s.output_token_ids for s in run_sequential(engine, prompts)]


def test_a_restarted_engine_gets_hits_from_disk(tmp_path):
    prompts = shared_prompts(n=4)
    expect = reference(prompts)
    with LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False), offload=with_disk(tmp_path)) as engine:
        assert [s.output_token_ids for s in run_sequential(engine, prompts)] == expect
    with LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False), offload=with_disk(tmp_path)) as engine:
        seqs = run_sequential(engine, prompts)
        assert [s.output_token_ids for s in seqs] == expect
        assert seqs[0].metrics.external_hit_tokens == 192       # nothing in L0 or L1: all from disk
        stats = engine.stats()["connector"]
        assert stats["tiers"]["disk"]["loaded"] >= 3 and stats["ask_again"] >= 1
        assert_back_to_baseline(engine)


def test_corrupt_files_are_misses_and_the_engine_recomputes(tmp_path):
    prompts = shared_prompts(n=3)
    expect = reference(prompts)
    with LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False), offload=with_disk(tmp_path)) as engine:
        run_sequential(engine, prompts)
    files = list(tmp_path.rglob("*.chunk"))
    assert files
    for f in files:                                   # flip one payload byte in every chunk
        raw = bytearray(f.read_bytes())
        raw[-1] ^= 0x01
        f.write_bytes(raw)
    with LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False), offload=with_disk(tmp_path)) as engine:
        seqs = run_sequential(engine, prompts)
        assert [s.output_token_ids for s in seqs] == expect
        disk = engine.stats()["connector"]["tiers"]["disk"]
        assert disk["integrity_failures"] >= 1 and disk["loaded"] == 0
        assert seqs[0].metrics.external_hit_tokens == 0      # the corrupt prefix was never loaded
        assert_back_to_baseline(engine)


def test_a_full_disk_only_costs_the_copies(tmp_path, monkeypatch):
    prompts = shared_prompts(n=4)
    expect = reference(prompts)
    real = os.writev

    def full(fd, parts):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "writev", full)
    cfg = with_disk(tmp_path, write_mode="write-through")
    with LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False), offload=cfg) as engine:
        seqs = run_sequential(engine, prompts)
        assert [s.output_token_ids for s in seqs] == expect
        assert seqs[1].metrics.external_hit_tokens == 192      # L1 still serves hits
        disk = engine.stats()["connector"]["tiers"]["disk"]
        assert disk["errors"] >= 3 and disk["chunks"] == 0 and disk["used_bytes"] == 0
        assert_back_to_baseline(engine)
    monkeypatch.setattr(os, "writev", real)
    assert not list(tmp_path.rglob("*.tmp"))
