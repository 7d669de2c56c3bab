"""Resume points through a chunk's whole life, on the reference engine's hybrid model (`HYBRID_MODEL`): a
finished turn's partial last chunk is stored with the resume point at its end and the next turn loads both;
retention takes a resume point with its chunk; an encrypted disk keeps resume points as ciphertext that only the
tenant's key opens. Each checks greedy tokens against a run with every cache off."""
import random
import time

from tests.support.engine_runs import offload, run_sequential
from tiercache.engine import EngineConfig, LLMEngine, SamplingParams
from tiercache.engine.config import HYBRID_MODEL

NO_L0 = EngineConfig(enable_prefix_caching=False)
KEY_A, KEY_B = "11" * 32, "22" * 32


def _prompts(n: int = 2, prefix: int = 200, suffix: int = 24) -> list[list[int]]:
    rng = random.Random(7)
    head = [256] + [rng.randrange(32, 127) for _ in range(prefix)]
    return [head + [rng.randrange(32, 127) for _ in range(suffix)] for _ in range(n)]


def _baseline(prompts: list[list[int]], max_tokens: int = 6) -> list[list[int]]:
    with LLMEngine(model_cfg=HYBRID_MODEL, engine_cfg=NO_L0) as engine:
        return [s.output_token_ids for s in run_sequential(engine, prompts, max_tokens)]


def _files(root) -> list:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def test_a_finished_turn_stores_its_partial_chunk_with_the_resume_point_at_its_end_and_the_next_turn_loads_it():
    """Turn one (234 prompt tokens + 6 generated, continuing) stores three whole 64-token chunks and its
    partial fourth (14 blocks computed: 224 tokens, the last sampled token never is) with a resume point at its
    end; turn two resends all of it and a question, loads 224 tokens — window and state included — and answers
    as a run without any cache."""
    first = _prompts(1, prefix=209)[0]
    with LLMEngine(model_cfg=HYBRID_MODEL, engine_cfg=NO_L0) as engine:
        turn = engine.add_request(first, SamplingParams(max_tokens=6, ignore_eos=True))
        engine.run()
    second = first + turn.output_token_ids + [40, 41, 42, 43, 44]
    expected = _baseline([second])

    with LLMEngine(model_cfg=HYBRID_MODEL, engine_cfg=NO_L0, offload=offload()) as engine:
        one = engine.add_request(first, SamplingParams(max_tokens=6, ignore_eos=True), continues=True)
        engine.run()
        assert one.output_token_ids == turn.output_token_ids
        assert engine.stats()["connector"]["tail_stores"] == 1
        two = engine.add_request(second, SamplingParams(max_tokens=6, ignore_eos=True))
        engine.run()
        assert two.output_token_ids == expected[0]
        assert two.metrics.external_hit_tokens == 14 * 16                 # the partial chunk's end, not 192


def test_a_resume_point_expires_with_its_chunk(tmp_path):
    """Within the disk's retention a fresh engine loads the prefix (chunks and resume point) from disk; past it
    nothing is served and all four expire together — the resume point is no longer-lived than its chunk — and
    the engine, computing the prefix again, stores all four again."""
    prompts = _prompts(2)
    expected = _baseline(prompts)
    disk = {"enabled": True, "path": str(tmp_path), "write_mode": "write-through", "retention": 100}
    with LLMEngine(model_cfg=HYBRID_MODEL, engine_cfg=NO_L0, offload=offload(disk=disk)) as engine:
        assert run_sequential(engine, prompts[:1])[0].output_token_ids == expected[0]
    assert len(_files(tmp_path)) == 3 + 1                       # three chunks, the resume point at the third's end
    for advance, hit in ((50, 192), (150, 0)):
        clock = Clock()
        clock.now += advance
        with LLMEngine(model_cfg=HYBRID_MODEL, engine_cfg=NO_L0, offload=offload(disk=disk)) as engine:
            manager = engine.connector.scheduler.manager
            for tier in manager.tiers:
                tier.clock = clock
            seq = run_sequential(engine, prompts[1:])[0]
            assert seq.output_token_ids == expected[1] and seq.metrics.external_hit_tokens == hit
            disk_stats = engine.stats()["connector"]["tiers"]["disk"]
        assert (disk_stats["expired"], disk_stats["stored"]) == ((0, 0) if hit else (4, 4))
    assert len(_files(tmp_path)) == 4


def test_resume_points_on_an_encrypted_disk_are_ciphertext_that_only_the_tenants_key_opens(tmp_path):
    prompts = _prompts(3)
    expected = _baseline(prompts)
    keys = {}
    for name, key in (("a", KEY_A), ("b", KEY_B)):
        keys[name] = tmp_path / f"{name}.keys"
        keys[name].write_text(f"1 {key} active\n")

    def engine(keys_file):
        disk = {"enabled": True, "path": str(tmp_path / "disk"), "write_mode": "write-through"}
        return LLMEngine(model_cfg=HYBRID_MODEL, engine_cfg=NO_L0,
                         offload=offload(disk=disk, format={"encryption_keys_file": str(keys_file)}))

    with engine(keys["a"]) as first:
        assert run_sequential(first, prompts[:1])[0].output_token_ids == expected[0]
        states = first.kv.states                   # the linear layer's state after each block the engine computed
        rows = [states[:, b].numpy().tobytes() for b in range(states.shape[1]) if states[:, b].any()]
    files = [p.read_bytes() for p in _files(tmp_path / "disk")]
    assert len(files) == 4 and rows
    assert not any(row[i:i + 32] in f for f in files for row in rows for i in range(0, len(row) - 32, 256))
    with engine(keys["a"]) as again:
        seq = run_sequential(again, prompts[1:2])[0]
        assert seq.output_token_ids == expected[1] and seq.metrics.external_hit_tokens == 192
    with engine(keys["b"]) as other:                           # another tenant's key: misses, same tokens
        seq = run_sequential(other, prompts[2:])[0]
        assert seq.output_token_ids == expected[2] and seq.metrics.external_hit_tokens == 0
        assert other.stats()["connector"]["tiers"]["disk"]["integrity_failures"] >= 1
