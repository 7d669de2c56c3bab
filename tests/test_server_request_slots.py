"""The server's request slots under a tenant that opens calls by the hundred (`CacheService`): the calls of one
tenant waiting for a slot are at most as many as there are slots, the rest refused at once, and refusals for a
busy server are counted each but logged once per kind and window."""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

import pytest

grpc = pytest.importorskip("grpc", reason="grpcio is not installed (pip install 'tiercache[grpc]')")

from tiercache.server.cpu_shares import CpuShares  # noqa: E402
from tiercache.server.fair import InflightBytes  # noqa: E402
from tiercache.server.limits import ServerLimits  # noqa: E402
from tiercache.server.rpc_calls import Rejected  # noqa: E402
from tiercache.server.service import REQUEST_SILENT_S, CacheService  # noqa: E402
from tiercache.server.store import StoreConfig  # noqa: E402
from tiercache.server.tenants import Tenancy, load_tenants  # noqa: E402

MiB = 1 << 20


class Call:
    """A call as the slots see it: ``abort`` ends it, ``peer`` names its client, and its status is set."""

    def __init__(self) -> None:
        self.code = None

    def abort(self, code, details) -> None:
        raise RuntimeError(details)

    def peer(self) -> str:
        return "ipv4:127.0.0.1:5555"

    def set_code(self, code) -> None:
        self.code = code

    def set_details(self, details) -> None:
        pass


@pytest.fixture
def service(tmp_path):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[tenants.acme]\ntoken = "acme-token-0123456789"\n'
                       '[tenants.rival]\ntoken = "rival-token-0123456789"\n')
    tenancy = Tenancy(load_tenants(str(tenants)), StoreConfig(16 * MiB))
    limits = ServerLimits.for_server(16 * MiB, workers=8)
    pool = ThreadPoolExecutor(2)
    service = CacheService(tenancy, MiB, limits, InflightBytes(limits.max_inflight_bytes), pool, CpuShares(1.0))
    yield service
    service.close()
    pool.shutdown()


def fill_slots(service: CacheService) -> list[int]:
    """Every request slot taken by calls that keep moving (none silent, so none taken back): the rival's as
    many as it may take alone, acme's the rest."""
    limit = service.requests.limit
    held = [service.requests.admit(Call(), "rival") for _ in range(limit - 2)]
    held += [service.requests.admit(Call(), "acme") for _ in range(2)]
    assert None not in held and service.requests.open == limit
    return held


def test_a_tenants_calls_waiting_for_a_request_slot_are_bounded_and_the_rest_refused_at_once(service):
    held = fill_slots(service)
    limit = service.requests.limit

    async def flood() -> None:
        waits = [asyncio.create_task(service._wait_for_request_slot(Call(), "acme")) for _ in range(limit + 5)]
        await asyncio.sleep(0)                  # every call has asked once
        refused = [t for t in waits if t.done()]
        assert len(refused) == 5 and all(isinstance(t.exception(), Rejected) for t in refused)
        assert refused[0].exception().code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert service._waiting_for_slots["acme"] == limit
        service.requests.done(held[0])          # a rival call ends: one waiting call of acme's takes its slot
        await asyncio.sleep(3 * REQUEST_SILENT_S / 5)
        admitted = [t for t in waits if t.done() and t.exception() is None]
        assert len(admitted) == 1
        for t in waits:
            t.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
        assert not service._waiting_for_slots

    asyncio.run(flood())
    assert service.requests.refused == 5


def test_busy_refusals_are_each_counted_and_logged_once_per_window(service, caplog):
    busy = Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED, "no request slot free for tenant 'rival'; try again")
    bad = Rejected(grpc.StatusCode.INVALID_ARGUMENT, "malformed ContainsRequest")
    with caplog.at_level(logging.WARNING, logger="tiercache.server"):
        for _ in range(50):
            service._reject("contains", Call(), busy)
        for _ in range(3):
            service._reject("contains", Call(), bad)
    lines = [r.getMessage() for r in caplog.records]
    assert sum("RESOURCE_EXHAUSTED" in line for line in lines) == 1
    assert sum("INVALID_ARGUMENT" in line for line in lines) == 3
    assert service.counters["rejected_resource_exhausted"] == 50
