"""The documentation holds to the code: the generated reference pages match it, the README stays a front door,
the site's navigation names every page, and every block the docs mark runnable runs.

A block is runnable when the line just before its opening fence is ``<!-- runnable -->`` (invisible on the site
and on GitHub). Bash blocks run under ``bash -euo pipefail``, Python blocks under this interpreter, each from the
repository root with a fresh temporary directory as ``TMPDIR`` and ``XDG_CACHE_HOME`` (nothing lands in the
user's cache) and no ``TIERCACHE_*`` variable set. Runnable blocks are kept to seconds each.
"""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tiercache.config import TierCacheConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
MARK = "<!-- runnable -->"
BLOCK_TIMEOUT_S = 120


def _generator():
    spec = importlib.util.spec_from_file_location("tiercache_docs_gen_reference", DOCS / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def runnable_blocks() -> list[tuple[str, str, str]]:
    """(where, language, code) of every block marked runnable in the README and the pages under docs/."""
    blocks = []
    for path in [README, *sorted(DOCS.rglob("*.md"))]:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines[:-1]):
            if line.strip() != MARK:
                continue
            fence = re.fullmatch(r"(`{3,})(\w+)\s*", lines[i + 1])
            assert fence, f"{path.relative_to(ROOT)}:{i + 1}: {MARK} must stand just before a fenced block"
            end = lines.index(fence.group(1), i + 2)
            blocks.append((f"{path.relative_to(ROOT)}:{i + 2}", fence.group(2), "\n".join(lines[i + 2:end]) + "\n"))
    return blocks


RUNNABLE = runnable_blocks()


def test_the_generated_reference_pages_match_the_code():
    stale = _generator().stale()
    assert not stale, ", ".join(str(p.relative_to(ROOT)) for p in stale) + " differ from what the code makes: " \
        "run python docs/gen_reference.py"


def test_the_reference_file_of_every_default_loads_as_the_defaults(tmp_path):
    page = (DOCS / "reference" / "configuration.md").read_text()
    defaults = tmp_path / "defaults.toml"
    defaults.write_text(re.search(r"```toml\n(.*?)```", page, re.S).group(1))
    assert load_config(defaults, env={}) == TierCacheConfig()


def test_the_readme_is_a_front_door():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; the guides belong under docs/"
    # First, the two commands for a fresh machine: set up and run the demo, then run the tests.
    fence = lines.index("```bash")
    assert lines[:fence] == ["# tiercache", ""]
    setup, tests = lines[fence + 1], lines[fence + 2]
    assert setup.startswith("pip install torch==") and "tiercache demo" in setup
    assert tests.startswith("python3 -m pytest -q")
    assert lines[fence + 3] == "```"
    assert "\n### vLLM\n" in text       # tests/test_vllm_connector.py reads the configuration under it


def test_the_site_navigation_names_every_page_and_only_pages_that_exist():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def pages(nav) -> list[str]:
        out = []
        for entry in nav:
            for value in entry.values():
                out += pages(value) if isinstance(value, list) else [value]
        return out

    listed = pages(config["nav"])
    on_disk = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(listed) == on_disk


def test_the_docs_mark_runnable_blocks_in_the_readme_and_the_guides():
    where = {block[0].split(":")[0] for block in RUNNABLE}
    assert "README.md" in where and any(w.startswith("docs/") for w in where)


@pytest.mark.parametrize("where,language,code", RUNNABLE, ids=[block[0] for block in RUNNABLE])
def test_a_runnable_block_runs(where, language, code, tmp_path):
    commands = {"bash": ["bash", "-euo", "pipefail", "-c", code], "python": [sys.executable, "-c", code]}
    assert language in commands, f"{where}: a runnable block is bash or python, not {language}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERCACHE_")}
    env.update(TMPDIR=str(tmp_path), XDG_CACHE_HOME=str(tmp_path / "cache"),
               PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""))
    run = subprocess.run(commands[language], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=BLOCK_TIMEOUT_S)
    assert run.returncode == 0, f"{where} exited {run.returncode}:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}"
