"""Comments and docstrings in the library say what and why; figures live in benchmarks/RESULTS.md and history
in git. This test reads every comment and docstring under `tiercache/`, `connectors/` and `kernels/` and fails
on a measurement (a throughput, a speed-up, a latency), a pointer to RESULTS.md, or a past session."""
import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [ROOT / "tiercache", ROOT / "connectors", ROOT / "kernels"]

# Each rule: a name for the failure message and the pattern that finds it.
RULES = {
    "points at RESULTS.md": re.compile(r"RESULTS(\.md)?\b"),
    "reports a measurement": re.compile(r"\bmeasur(ed|ing|ement)s?\b", re.I),
    "tells a past session": re.compile(r"\b(session|sessions)\s+\d+|\b(last|earlier|previous|this) session\b", re.I),
    "quotes a throughput": re.compile(r"\d\s*(GB|MB|GiB|MiB|KB|KiB|Gb|Mb|tok|tokens|chunks|req|requests)/s\b"),
    "quotes a speed-up": re.compile(r"\d(\.\d+)?\s*[×x]\s*(faster|slower|the|more|less|fewer|of)\b|\d\.\d+\s*×"),
    "quotes a latency": re.compile(r"\b\d+(\.\d+)?\s*(ms|µs|us)\b"),
}


def _texts(path: Path):
    """(line, text) of every comment and docstring in ``path``."""
    source = path.read_text()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield node.body[0].lineno, doc


def _violations() -> list[str]:
    found = []
    for directory in SOURCES:
        for path in sorted(directory.rglob("*.py")):
            for line, text in _texts(path):
                for rule, pattern in RULES.items():
                    if pattern.search(text):
                        found.append(f"{path.relative_to(ROOT)}:{line}: {rule}: {pattern.search(text).group(0)!r}")
    return found


def test_comments_and_docstrings_carry_no_figures_or_history():
    found = _violations()
    assert not found, "figures and history belong in RESULTS.md and git:\n" + "\n".join(found)


@pytest.mark.parametrize("text, rule", [
    ("# copies at 12.5 GB/s on this machine", "quotes a throughput"),
    ('"""See RESULTS.md for why."""', "points at RESULTS.md"),
    ("# measured: 3 ms a chunk", "reports a measurement"),
    ("# since session 12 this path", "tells a past session"),
    ("# 2.4× faster than the old path", "quotes a speed-up"),
])
def test_the_rules_catch_what_they_name(text, rule):
    assert RULES[rule].search(text)
