"""The config tree: defaults, sources in order, and errors that name the field."""
import pytest

from tiercache.config import TierCacheConfig, load_config, parse_size
from tiercache.errors import ConfigError


def test_defaults_are_valid_and_sizes_parse():
    cfg = load_config(env={})
    assert cfg == TierCacheConfig()
    assert cfg.keys.blocks_per_chunk == 16
    assert parse_size("8GiB") == 8 << 30
    assert parse_size("1.5 KiB") == 1536
    assert parse_size("2MB") == 2_000_000
    assert parse_size(4096) == 4096


def test_file_then_env_then_cli_each_win(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[cpu]\ncapacity = "64MiB"\neviction = "fifo"\n[keys]\nchunk_tokens = 512\n')
    cfg = load_config(toml, env={})
    assert (cfg.cpu.capacity, cfg.cpu.eviction, cfg.keys.chunk_tokens) == (64 << 20, "fifo", 512)

    cfg = load_config(toml, env={"TIERCACHE_CPU__CAPACITY": "128MiB"})
    assert cfg.cpu.capacity == 128 << 20

    cfg = load_config(toml, env={"TIERCACHE_CPU__CAPACITY": "128MiB"}, overrides=["cpu.capacity=1GiB"])
    assert cfg.cpu.capacity == 1 << 30

    yaml = tmp_path / "c.yaml"
    yaml.write_text("transfer:\n  workers: 3\ncpu:\n  prefault: false\n")
    cfg = load_config(yaml, env={})
    assert cfg.transfer.workers == 3 and cfg.cpu.prefault is False


@pytest.mark.parametrize(
    "override, field",
    [
        ("keys.chunk_tokens=100", "keys.chunk_tokens"),   # not a multiple of the block size
        ("keys.block_size=0", "keys.block_size"),
        ("cpu.capacity=lots", "cpu.capacity"),
        ("cpu.capcity=1GiB", "cpu.capcity"),              # misspelt field
        ("nosuch.field=1", "nosuch"),                     # unknown section
        ("cpu.prefault=maybe", "cpu.prefault"),
        ("transfer.workers=0", "transfer.workers"),
        ("device_pool.device=tpu", "device_pool.device"),
        ("cpu.pin_memory=sometimes", "cpu.pin_memory"),
    ],
)
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ConfigError) as err:
        load_config(env={}, overrides=[override])
    assert err.value.field == field
    assert field in str(err.value)


def test_bad_env_and_file_name_their_source(tmp_path):
    with pytest.raises(ConfigError, match="cpu.capacity.*; set by TIERCACHE_CPU__CAPACITY") as err:
        load_config(env={"TIERCACHE_CPU__CAPACITY": "-"})
    assert err.value.field == "cpu.capacity"
    with pytest.raises(ConfigError, match="cpu.capcity.*; set by TIERCACHE_CPU__CAPCITY"):
        load_config(env={"TIERCACHE_CPU__CAPCITY": "1GiB"})
    with pytest.raises(ConfigError) as err:         # --set wins over the environment: its value is the bad one
        load_config(env={"TIERCACHE_CPU__CAPACITY": "1GiB"}, overrides=["cpu.capacity=-"])
    assert "TIERCACHE_" not in str(err.value)
    bad = tmp_path / "bad.yaml"
    bad.write_text("cpu: [1, 2\n")
    with pytest.raises(ConfigError, match="--config"):
        load_config(bad, env={})
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml", env={})
    with pytest.raises(ConfigError, match="section.field=value"):
        load_config(env={}, overrides=["cpu.capacity"])


def test_replace_validates_too():
    cfg = TierCacheConfig().replace(cpu={"capacity": "2GiB"})
    assert cfg.cpu.capacity == 2 << 30
    with pytest.raises(ConfigError, match="keys.chunk_tokens"):
        cfg.replace(keys={"chunk_tokens": 17})
