"""EtcdRegistration's rounds against a fake gateway: lease renewal, re-creation, puts per round."""

from __future__ import annotations

from typing import Any

import pytest

import kvwire.discovery.etcd_client as etcd_client
from kvwire.discovery import InstanceInfo, InstanceLoad, parse_discovery_address
from kvwire.discovery.etcd_client import EtcdRegistration
from kvwire.discovery.etcd_gateway import EtcdError, decode_record
from kvwire.protocol.kv_params import Role


class FakeEtcd:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.leases: set[int] = set()
        self.records: dict[str, bytes] = {}
        self.down = False
        self._next = 100

    def _check(self) -> None:
        if self.down:
            raise EtcdError("down")

    def grant(self, ttl_s: int) -> int:
        self._check()
        self._next += 1
        self.leases.add(self._next)
        self.calls.append(("grant", ttl_s))
        return self._next

    def keepalive(self, lease: int) -> int:
        self._check()
        self.calls.append(("keepalive", lease))
        return 6 if lease in self.leases else 0

    def put(self, key: str, value: bytes, lease: int) -> None:
        self._check()
        self.calls.append(("put", lease))
        self.records[key] = value

    def revoke(self, lease: int) -> None:
        self.leases.discard(lease)

    def close(self) -> None:
        pass

    def kinds(self) -> list[str]:
        out = [c[0] for c in self.calls]
        self.calls.clear()
        return out


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(etcd_client.time, "monotonic", lambda: now[0])
    return now


def make(load: list[int], **kwargs: Any) -> tuple[EtcdRegistration, FakeEtcd]:
    info = InstanceInfo(instance_id="p0", role=Role.PREFILL, url="http://h:1", model="m")
    reg = EtcdRegistration(parse_discovery_address("etcd://h:2379"), info,
                           lambda: InstanceLoad(num_running=load[0]), interval_s=1.0, **kwargs)
    fake = FakeEtcd()
    reg._http = fake  # type: ignore[assignment]
    return reg, fake


def record(fake: FakeEtcd) -> Any:
    return decode_record(fake.records["/kvwire/instances/p0"])


def test_registers_then_renews_and_puts_every_interval(clock: list[float]) -> None:
    """Default: each round renews the lease and puts the record, which promises the next one within
    the lease TTL (routers expire on that); a changed load between rounds is rate-limited."""
    load = [0]
    reg, fake = make(load)
    assert (reg.lease_ttl_s, reg.min_put_interval_s, reg.refresh_s) == (3, 1.0, 1.0)
    reg.tick()
    assert fake.kinds() == ["grant", "put"]
    assert record(fake).info.instance_id == "p0" and record(fake).ttl_s == 3.0
    clock[0] += 1.0
    reg.tick()  # load unchanged: still renewed and put (the record is the router's heartbeat)
    assert fake.kinds() == ["keepalive", "put"]
    load[0] = 5
    clock[0] += 0.4
    reg.tick()  # a send_now 0.4 s later with a new load: rate-limited
    assert fake.kinds() == ["keepalive"]
    clock[0] += 0.6
    reg.tick()
    assert fake.kinds() == ["keepalive", "put"] and record(fake).load == InstanceLoad(num_running=5)
    assert record(fake).seq == 3


def test_fewer_puts_on_request_then_no_promise(clock: list[float]) -> None:
    """refresh_s above the interval: puts only on a load change (at most one per interval) and at
    least one per refresh_s; the records promise nothing (routers rely on the lease)."""
    load = [0]
    reg, fake = make(load, refresh_s=3.0)
    reg.tick()
    assert fake.kinds() == ["grant", "put"] and record(fake).ttl_s == 0.0
    clock[0] += 1.0
    reg.tick()  # load unchanged, refresh not due: only the keep-alive
    assert fake.kinds() == ["keepalive"]
    load[0] = 5
    clock[0] += 0.5
    reg.tick()  # changed, the last put 1.5 s ago >= 1 s: put
    assert fake.kinds() == ["keepalive", "put"]
    load[0] = 6
    clock[0] += 0.3
    reg.tick()  # changed again 0.3 s later: rate-limited
    assert fake.kinds() == ["keepalive"]
    clock[0] += 3.0
    reg.tick()
    assert fake.kinds() == ["keepalive", "put"]
    assert record(fake).seq == 3


def test_lost_lease_is_recreated_and_outage_is_survived(clock: list[float]) -> None:
    reg, fake = make([1])
    reg.tick()
    first = reg.lease
    fake.down = True
    clock[0] += 1.0
    reg.tick()  # etcd down: counted, no exception
    assert reg.dropped == 1 and reg.lease == first
    fake.down = False
    fake.leases.clear()  # etcd came back without its data
    fake.calls.clear()
    clock[0] += 1.0
    reg.tick()
    assert fake.kinds() == ["keepalive", "grant", "put"]
    assert reg.lease != first and reg.leases_granted == 2
