"""What the machine says about itself: a core's cache sizes, read from sysfs (a tree written here)."""
from tiercache.machine import CORE_CACHE_BYTES, core_cache_bytes


def _cache(root, index: int, level: int, kind: str, size: str) -> None:
    d = root / f"index{index}"
    d.mkdir(parents=True)
    (d / "level").write_text(f"{level}\n")
    (d / "type").write_text(f"{kind}\n")
    (d / "size").write_text(f"{size}\n")


def test_a_cores_caches_are_read_by_level_and_kind(tmp_path):
    _cache(tmp_path, 0, 1, "Data", "48K")
    _cache(tmp_path, 1, 1, "Instruction", "32K")
    _cache(tmp_path, 2, 2, "Unified", "2M")
    _cache(tmp_path, 3, 3, "Unified", "32768K")
    assert core_cache_bytes(1, tmp_path) == 48 << 10       # the data cache, not the instruction cache
    assert core_cache_bytes(2, tmp_path) == 2 << 20
    assert core_cache_bytes(3, tmp_path) == 32 << 20


def test_a_machine_that_does_not_say_gets_the_default(tmp_path):
    assert core_cache_bytes(2, tmp_path / "absent") == CORE_CACHE_BYTES
    _cache(tmp_path, 0, 2, "Unified", "big")              # unreadable size: not guessed from
    assert core_cache_bytes(2, tmp_path) == CORE_CACHE_BYTES
    _cache(tmp_path / "only-l1", 0, 1, "Data", "32K")
    assert core_cache_bytes(2, tmp_path / "only-l1") == CORE_CACHE_BYTES
