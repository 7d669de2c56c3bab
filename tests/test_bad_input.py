"""Every mistake gets one clear line before any work starts: exit code 2, the flag, field or file and the
value named, no traceback — whichever way the value came in (flag, ``--set``, ``TIERCACHE_*``, YAML, TOML).

The table runs `tiercache.cli.main` in this process (an uncaught exception fails the test as surely as a
traceback would); a few cases run the real command in a subprocess, end to end.
"""
from __future__ import annotations

import contextlib
import io
import socket
import subprocess
import sys

import pytest

from tiercache.cli import main

PHYSICAL = "100TiB"   # more memory than any machine here has

# (field, a bad value, how the error line shows the value): each goes in through every config form.
# Sizes are shown in bytes once parsed; numbers as numbers.
CONFIG_CASES = [
    ("cpu.capacity", PHYSICAL, str(100 << 40)),
    ("cpu.capacity", "1000TiB", str(1000 << 40)),
    ("cpu.capacity", "0", "0"),
    ("cpu.capacity", "huge", "huge"),
    ("cpu.eviction", "bogus", "bogus"),
    ("cpu.pin_memory", "maybe", "maybe"),
    ("cpu.prefault", "perhaps", "perhaps"),
    ("cpu.shutdown_write_down", "-1", "-1"),
    ("cpu.shutdown_write_down", "inf", "inf"),
    ("cpu.admission", "sometimes", "sometimes"),
    ("cpu.admission", "min-hits", "min-hits"),
    ("cpu.min_hits", "-1", "-1"),
    ("disk.capacity", "-1", "-1"),
    ("disk.eviction", "bogus", "bogus"),
    ("disk.write_mode", "sideways", "sideways"),
    ("disk.promotion", "teleport", "teleport"),
    ("disk.admission", "sometimes", "sometimes"),
    ("disk.min_hits", "-2", "-2"),
    ("redis.url", "http://x", "http://x"),
    ("redis.ttl", "-1", "-1"),
    ("redis.ttl", "99999999999", "99999999999"),
    ("redis.timeout", "0", "0"),
    ("redis.timeout", "nan", "nan"),
    ("redis.lookup_timeout", "inf", "inf"),
    ("redis.retry_interval", "inf", "inf"),
    ("redis.retry_interval", "-1", "-1"),
    ("redis.write_mode", "never", "never"),
    ("grpc.address", "no-port", "no-port"),
    ("grpc.address", "host:99999", "host:99999"),
    ("grpc.timeout", "inf", "inf"),
    ("grpc.timeout", "1e300", "1e+300"),
    ("grpc.retry_interval", "inf", "inf"),
    ("grpc.max_message", "1KiB", "1024"),
    ("grpc.local", "always", "always"),
    ("grpc.bulk", "always", "always"),
    ("keys.hash", "md5", "md5"),
    ("keys.chunk_tokens", "100", "100"),
    ("keys.block_size", "0", "0"),
    ("format.codec", "zip", "zip"),
    ("format.checksum", "md5", "md5"),
    ("transfer.workers", "1.5", "1.5"),
    ("transfer.workers", "0", "0"),
    ("transfer.inline_host_copies", "sometimes", "sometimes"),
    ("transfer.host_disk_rate", "-5", "-5"),
    ("device_pool.device", "tpu", "tpu"),
    ("cpu.nosuchfield", "1", "1"),
]

# (argv, what the error line must name, the value it must show)
FLAG_CASES = [
    (["demo", "--metrics-port", "99999"], "--metrics-port", "99999"),
    (["demo", "--metrics-port", "-1"], "--metrics-port", "-1"),
    (["demo", "--l0-blocks", "0"], "--l0-blocks", "0"),
    (["demo", "--l0-blocks", "100000000000"], "--l0-blocks", "100000000000"),
    (["demo", "--requests", "0"], "--requests", "0"),
    (["demo", "--workload", "long-doc", "--l0-blocks", "100"], "--l0-blocks", "100"),
    (["demo", "--workload", "nope"], "--workload", "nope"),
    (["demo", "--tiers", "disk"], "--tiers", "disk"),
    (["demo", "--tiers", "cpu,tape"], "--tiers", "tape"),
    (["demo", "--set", "cpu"], "--set", "cpu"),
    (["demo", "--config", "/nonexistent/tiercache.yaml"], "--config", "/nonexistent/tiercache.yaml"),
    (["serve", "--metrics-port", "99999"], "--metrics-port", "99999"),
    (["serve", "--port", "70000"], "--port", "70000"),
    (["serve", "--host", "999.1.1.1"], "--host", "999.1.1.1"),
    (["serve", "--host", "nohost.invalid"], "--host", "nohost.invalid"),
    (["serve", "--grace", "nan"], "--grace", "nan"),
    (["serve", "--grace", "-1"], "--grace", "-1"),
    (["serve", "--capacity", PHYSICAL], "--capacity", str(100 << 40)),
    (["serve", "--capacity", "lots"], "--capacity", "lots"),
    (["serve", "--max-message", "1"], "--max-message", "1"),
    (["serve", "--workers", "0"], "--workers", "0"),
    (["serve", "--cpu-cores", "-0.5"], "--cpu-cores", "-0.5"),
    (["serve", "--cpu-cores", "inf"], "--cpu-cores", "inf"),
    (["serve", "--eviction", "bogus"], "--eviction", "bogus"),
    (["serve", "--disk-capacity", "1GiB"], "--disk-capacity", str(1 << 30)),
    (["serve", "--port", "0", "--disk", "/proc/tiercache-l2"], "--disk", "/proc/tiercache-l2"),
    (["serve", "--port", "0", "--disk", "/proc"], "--disk", "/proc"),
    (["generate", "--prompt", "hi", "--temperature", "nan"], "--temperature", "nan"),
    (["generate", "--prompt", "hi", "--temperature", "-1"], "--temperature", "-1"),
    (["generate", "--prompt", "hi", "--max-tokens", "0"], "--max-tokens", "0"),
    (["stats", "--server", "nohost"], "--server", "nohost"),
    (["stats", "--server", "localhost:99999"], "--server", "localhost:99999"),
    (["stats", "--timeout", "inf"], "--timeout", "inf"),
    (["bench", "tiers", "--chunk-tokens", "100"], "--chunk-tokens", "100"),
    (["bench", "tiers", "--total-mib", "-3"], "--total-mib", "-3"),
    (["bench", "tiers", "--tiers", "floppy"], "--tiers", "floppy"),
    (["bench", "tiers", "--tiers", "cpu,disk", "--disk-path", "/proc/tiercache-bench"], "--disk-path",
     "/proc/tiercache-bench"),
    (["bench", "codecs", "--no-accuracy", "--disk-path", "/proc/tiercache-bench"], "--disk-path",
     "/proc/tiercache-bench"),
    (["bench", "trace", "--trace", "/nonexistent.jsonl"], "/nonexistent.jsonl", "/nonexistent.jsonl"),
]


def run_main(argv: list[str]) -> tuple[int, list[str]]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(argv)
        except SystemExit as exit_:
            rc = exit_.code
    return rc, [line for line in err.getvalue().splitlines() if line.strip()]


def assert_one_clear_line(rc: int, lines: list[str], names: str, value: str) -> None:
    assert rc == 2, lines
    errors = [line for line in lines if "error" in line]
    assert len(errors) == 1, lines
    assert names in errors[0] and value in errors[0], errors[0]
    assert not any("Traceback" in line for line in lines)
    assert lines[-1] == errors[0], lines      # nothing ran after it


@pytest.fixture(autouse=True)
def _quiet_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for name in [n for n in __import__("os").environ if n.startswith("TIERCACHE_")]:
        monkeypatch.delenv(name)


@pytest.mark.parametrize("form", ["set", "env", "yaml", "toml"])
@pytest.mark.parametrize("field,value,shown", CONFIG_CASES, ids=[f"{c[0]}={c[1]}" for c in CONFIG_CASES])
def test_a_bad_config_value_is_one_line_naming_it(tmp_path, monkeypatch, form, field, value, shown):
    section, name = field.split(".")
    argv = ["demo", "--tiers", "cpu,disk,redis,grpc", "--requests", "1"]
    if form == "set":
        argv += ["--set", f"{field}={value}"]
    elif form == "env":
        monkeypatch.setenv(f"TIERCACHE_{section.upper()}__{name.upper()}", value)
    elif form == "yaml":
        (tmp_path / "c.yaml").write_text(f"{section}:\n  {name}: {value}\n")
        argv += ["--config", str(tmp_path / "c.yaml")]
    else:
        literal = value if _toml_number(value) else f'"{value}"'
        (tmp_path / "c.toml").write_text(f"[{section}]\n{name} = {literal}\n")
        argv += ["--config", str(tmp_path / "c.toml")]
    rc, lines = run_main(argv)
    assert_one_clear_line(rc, lines, "format" if section == "format" else field, shown)
    if form == "env":           # the line names the variable as well as the field
        assert f"TIERCACHE_{section.upper()}__{name.upper()}" in lines[-1], lines[-1]


def _toml_number(value: str) -> bool:
    if value in ("inf", "nan"):
        return True
    try:
        float(value)
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("argv,names,value", FLAG_CASES, ids=[" ".join(c[0]) for c in FLAG_CASES])
def test_a_bad_flag_is_one_line_naming_it(argv, names, value):
    rc, lines = run_main(argv)
    assert_one_clear_line(rc, lines, names, value)


def test_files_and_environment_that_cannot_be_read(tmp_path, monkeypatch):
    binary = tmp_path / "tiercache.yaml"
    binary.write_bytes(b"\x00\x01\xff\xfe")
    assert_one_clear_line(*run_main(["demo", "--config", str(binary)]), "--config", str(binary))
    broken = tmp_path / "broken.toml"
    broken.write_text("[cpu\ncapacity = 1")
    assert_one_clear_line(*run_main(["demo", "--config", str(broken)]), "--config", str(broken))
    top = tmp_path / "list.yaml"
    top.write_text("- 1\n- 2\n")
    assert_one_clear_line(*run_main(["demo", "--config", str(top)]), "--config", str(top))
    monkeypatch.setenv("TIERCACHE_CPU", "1")
    assert_one_clear_line(*run_main(["demo"]), "TIERCACHE_CPU", "1")


def test_ports_in_use_are_named(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        assert_one_clear_line(*run_main(["serve", "--port", port]), "--port", port)
        assert_one_clear_line(*run_main(["serve", "--port", "0", "--metrics-port", port]), "--metrics-port", port)
        assert_one_clear_line(*run_main(["demo", "--requests", "1", "--metrics-port", port]),
                              "--metrics-port", port)


def test_an_impossible_stack_fails_before_any_request(tmp_path):
    """Each mistake is found while the stack is checked and built, before the engine exists: the one line is
    all that is printed (no table, no request)."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cases = [
        (["demo", "--tiers", "cpu,disk,redis,grpc", "--grpc-address", "no-port"], "grpc.address", "no-port"),
        (["demo", "--tiers", "cpu,disk", "--disk-path", str(blocker / "l2")], "disk.path", str(blocker)),
        (["demo", "--tiers", "cpu", "--set", "cpu.capacity=1KiB"], "cpu.capacity", "1024"),
    ]
    for argv, names, value in cases:
        rc, lines = run_main(argv)
        assert_one_clear_line(rc, lines, names, value)
        assert len(lines) == 1, lines


def test_the_real_command_prints_one_line_and_no_traceback(tmp_path):
    for argv, names in [(["demo", "--set", f"cpu.capacity={PHYSICAL}"], "cpu.capacity"),
                        (["serve", "--host", "nohost.invalid"], "--host"),
                        (["demo", "--metrics-port", "99999"], "--metrics-port")]:
        proc = subprocess.run([sys.executable, "-m", "tiercache.cli", *argv], capture_output=True, text=True,
                              timeout=120, env={"XDG_CACHE_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.count("\n") == 1 and names in proc.stderr, proc.stderr


def test_bench_codecs_without_transformers_names_the_extra_before_any_work(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a)
    )
    rc, lines = run_main(["bench", "codecs"])
    assert rc == 1 and len(lines) == 1, lines
    assert "transformers" in lines[0] and "tiercache[bench]" in lines[0] and "--model" not in lines[0].split(":")[1]
