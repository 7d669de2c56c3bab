"""The package as users install it: the wheel and the sdist hold every module of the source tree.

`pyproject.toml` lists the packages by hand (connectors/ and kernels/ install as tiercache.connectors and
tiercache.kernels), so a new subpackage that is not listed, or lacks its ``__init__.py``, would be missing
from every install but an editable one. This builds both archives, as ``python -m build`` does for a
release, and compares them with the tree.
"""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import tiercache

ROOT = Path(__file__).resolve().parents[1]
INSTALLED_AS = {"tiercache": "tiercache", "connectors": "tiercache/connectors", "kernels": "tiercache/kernels"}

pytestmark = pytest.mark.slow


def source_files() -> list[str]:
    """Every module of the source tree, relative to the repository."""
    return sorted(path.relative_to(ROOT).as_posix() for top in INSTALLED_AS for path in (ROOT / top).rglob("*.py")
                  if "__pycache__" not in path.parts)


def installed_path(source: str) -> str:
    top, rest = source.split("/", 1)
    return f"{INSTALLED_AS[top]}/{rest}"


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """The wheel (built from the tree, as ``pip wheel .`` does) and the sdist, from a clean copy of the
    checkout: what git tracks or would add, nothing a local build or an editable install left behind."""
    if importlib.util.find_spec("build") is None:
        pytest.skip("the `build` package is not installed (pip install -e '.[dev]')")
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=False)
    if listed.returncode:
        pytest.skip("not a git checkout: the clean copy is made from git's file list")
    clean, out = tmp_path_factory.mktemp("clean"), tmp_path_factory.mktemp("dist")
    for name in filter(None, listed.stdout.decode().split("\0")):
        if (ROOT / name).is_file():
            (clean / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, clean / name)
    for kind in ("--wheel", "--sdist"):
        subprocess.run([sys.executable, "-m", "build", kind, "--outdir", str(out), str(clean)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return out


def test_every_package_has_its_init_file():
    files = set(source_files())
    missing = sorted(
        {f.rsplit("/", 1)[0] for f in files} - {f.rsplit("/", 1)[0] for f in files if f.endswith("/__init__.py")}
    )
    assert not missing, f"directories of modules without __init__.py: {missing}"


def test_the_wheel_holds_every_module_of_the_tree_and_its_version(dist: Path):
    wheel = next(dist.glob("tiercache-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted({installed_path(f) for f in source_files()} - names)
    assert not missing, f"modules missing from {wheel.name}: {missing}"
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    assert f"\nVersion: {tiercache.__version__}\n" in text
    entry_points = zipfile.ZipFile(wheel).read(metadata.replace("METADATA", "entry_points.txt")).decode()
    assert "tiercache = tiercache.cli:main" in entry_points


def test_the_sdist_holds_every_module_of_the_tree(dist: Path):
    sdist = next(dist.glob("tiercache-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    missing = sorted(set(source_files()) - names)
    assert not missing, f"files missing from {sdist.name}: {missing}"
