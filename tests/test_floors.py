"""The import graph: every module lives on a floor and imports only from its own room or from floors below.

Floors, bottom to top (a module belongs to the longest prefix listed; the rooms of one floor do not import
each other). `KNOWN_UPWARD` lists the imports that still break the rule, each one the next thing to move;
the test fails on any other, and on a listed one that is gone (so the list stays true).

A floor above a room does not make it everyone's: `REACHED_ONLY_FROM` names the rooms that alone may import
a room (the client tiers are built and driven by the scheduler side; the engine and the router see them
only through the connector and what the tiers publish).
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FLOORS: list[dict[str, list[str]]] = [
    {"foundation": ["tiercache", "tiercache.errors", "tiercache.registry", "tiercache.log_limits",
                    "tiercache.machine", "tiercache.metrics", "tiercache.audit", "tiercache.arith"]},
    # the plain data both sides share: keys and KV layouts, plans, jobs, reports, failures, link limits, scan
    # results, what crosses the connector's sides
    {"contracts": ["tiercache.contracts"]},
    {"codecs": ["tiercache.codecs", "tiercache.kv_quant"], "policies": ["tiercache.policies"],
     "pool": ["tiercache.pool"], "kernels": ["tiercache.kernels"], "hot_chunks": ["tiercache.hot_chunks"]},
    # formats on disk and on the network, and the channels that speak them
    {"wire": ["tiercache.wire", "tiercache.cache_dir"]},
    {"config": ["tiercache.config", "tiercache.encryption_keys"]},
    # the connector's two interfaces (what crosses between them is in contracts)
    {"connector_api": ["tiercache.connector.api"]},
    # the index base the client tiers and the server's stores share
    {"index": ["tiercache.index"]},
    {"client_tiers": ["tiercache.tiers"], "server": ["tiercache.server"]},
    {"transfer": ["tiercache.transfer"], "scheduler": ["tiercache.manager", "tiercache.lookup",
                                                       "tiercache.tier_events"]},
    # what a replica publishes about itself: its descriptor, its measured load rates and its KV events (vLLM's
    # wire format)
    {"build": ["tiercache.build"], "replica_events": ["tiercache.fleet.descriptor", "tiercache.fleet.kv_events",
                                                      "tiercache.fleet.replica_events", "tiercache.fleet.load_rates"]},
    {"connector": ["tiercache.connector"]},
    {"connectors": ["tiercache.connectors"]},
    {"engine": ["tiercache.engine"]},
    # the router: above the engines it fronts (it parses requests as their API servers do)
    {"fleet": ["tiercache.fleet"]},
    # the deployment-wide tools: above the router (a purge hashes a prompt as a replica does)
    {"bench": ["tiercache.bench"], "purging": ["tiercache.purging"]},
    {"cli": ["tiercache.cli"]},
]

# (importer's room, imported room): upward or sideways imports still to remove (none left).
KNOWN_UPWARD: set[tuple[str, str]] = set()
# room: the rooms above it that may import it (besides itself). The client tiers: built by `build`, driven by
# the manager and the lookups (scheduler) and the transfer engine; the benchmarks and purges that work a tier
# directly.
REACHED_ONLY_FROM: dict[str, set[str]] = {
    "client_tiers": {"build", "scheduler", "transfer", "bench", "purging"},
}
SOURCES = {"tiercache": ROOT / "tiercache", "tiercache.connectors": ROOT / "connectors",
           "tiercache.kernels": ROOT / "kernels"}


def _modules() -> dict[str, Path]:
    out = {}
    for package, directory in SOURCES.items():
        for path in directory.rglob("*.py"):
            parts = path.relative_to(directory).with_suffix("").parts
            name = ".".join((package, *parts[:-1]) if parts[-1] == "__init__" else (package, *parts))
            out[name] = path
    return out


def _place(module: str) -> tuple[int, str] | None:
    """(floor, room) of the longest prefix that names ``module``."""
    best = None
    for level, rooms in enumerate(FLOORS):
        for room, prefixes in rooms.items():
            for prefix in prefixes:
                if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[0]):
                    best = (len(prefix), level, room)
    return None if best is None else best[1:]


def _imports(module: str, path: Path) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join([*base, node.module] if node.module else base)
            out.add(target)
            out.update(f"{target}.{a.name}" for a in node.names)
    return {name for name in out if name.startswith("tiercache")}


def _breaches() -> dict[tuple[str, str], list[str]]:
    modules = _modules()
    found: dict[tuple[str, str], list[str]] = {}
    for module, path in modules.items():
        here = _place(module)
        assert here is not None, f"{module} is on no floor: add it to FLOORS"
        for target in _imports(module, path):
            if target not in modules:      # `from package import name` also yields package.name
                continue
            there = _place(target)
            above = there[0] > here[0] or (there[0] == here[0] and there[1] != here[1])
            closed = there[1] != here[1] and here[1] not in REACHED_ONLY_FROM.get(there[1], {here[1]})
            if above or closed:
                found.setdefault((here[1], there[1]), []).append(f"{module} -> {target}")
    return found


def test_every_module_imports_only_its_own_room_and_the_floors_below():
    found = _breaches()
    new = {pair: found[pair] for pair in found.keys() - KNOWN_UPWARD}
    assert not new, f"imports above their floor, or into a room not theirs (move the shared part down): {new}"
    gone = KNOWN_UPWARD - found.keys()
    assert not gone, f"these upward imports are gone: take them off KNOWN_UPWARD: {sorted(gone)}"


def test_the_floors_see_a_module_by_its_longest_prefix():
    assert _place("tiercache.index.indexed_tier") == (6, "index")
    assert _place("tiercache.tiers.base") == (7, "client_tiers")
    assert _place("tiercache.contracts.medium") == (1, "contracts")
    assert _place("tiercache.contracts.plan") == (1, "contracts")
    assert _place("tiercache.transfer.links") == (8, "transfer")
