"""Zero-copy bookkeeping of the NCCL plane on CPU: the offer field, the config switch, and the
registrable-memory registry (lookup, per-communicator registration, pool reuse, release) with fake
buffers in place of ``ncclMemAlloc`` (the GPU side is tests/gpu/test_nccl_zero_copy.py)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import torch

from kvwire.errors import TransferError
from kvwire.transfer.planes.nccl.config import NcclPlaneConfig
from kvwire.transfer.planes.nccl.memory import ZeroCopyMemory, pool_size
from kvwire.transfer.planes.nccl.plane_info import CommOffer, NcclInfo, decode_info, encode_info

MiB = 1 << 20


class _FakeBuffer:
    def __init__(self, ptr: int, num_bytes: int) -> None:
        self.ptr = ptr
        self.num_bytes = num_bytes
        self.tensor = torch.empty(0, dtype=torch.uint8)
        self.closed = False

    def close(self) -> None:
        self.closed = True


class _FakeMemory(ZeroCopyMemory):
    """Buffers at made-up addresses, 1 GiB apart."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.made: list[_FakeBuffer] = []

    def _alloc(self, num_bytes: int) -> Any:
        buffer = _FakeBuffer((len(self.made) + 1) << 30, num_bytes)
        self.made.append(buffer)
        return buffer

    def slab(self, num_bytes: int) -> _FakeBuffer:
        self.allocate(num_bytes)
        return self.made[-1]


class _FakeComm:
    def __init__(self) -> None:
        self.registered: list[tuple[int, int]] = []
        self.deregistered: list[int] = []

    def register(self, ptr: int, num_bytes: int) -> int:
        self.registered.append((ptr, num_bytes))
        return 100 + len(self.registered)

    def deregister(self, handle: int) -> None:
        self.deregistered.append(handle)


def test_offer_carries_zero_copy_and_an_old_offer_decodes_without_it() -> None:
    uid = bytes(range(128))
    info = decode_info(encode_info(NcclInfo(offers=[CommOffer("c1", uid, zero_copy=True)])))
    assert info.offers[0].zero_copy is True
    # an offer encoded before the field existed: [comm_id, unique_id]
    old = msgspec.msgpack.encode({"v": 1, "offers": [["c1", uid]], "chunks": []})
    assert decode_info(old).offers[0].zero_copy is False


def test_zero_copy_is_on_by_default_and_env_switches_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert NcclPlaneConfig().zero_copy is True
    monkeypatch.setenv("KVWIRE_NCCL_ZERO_COPY", "0")
    assert NcclPlaneConfig.from_env().zero_copy is False
    monkeypatch.setenv("KVWIRE_NCCL_ZERO_COPY", "1")
    assert NcclPlaneConfig.from_env().zero_copy is True


def test_pool_sizes_are_powers_of_two_from_one_mib() -> None:
    assert pool_size(1) == MiB
    assert pool_size(MiB) == MiB
    assert pool_size(MiB + 1) == 2 * MiB
    assert pool_size(100 * MiB) == 128 * MiB


def test_find_only_ranges_inside_one_buffer() -> None:
    memory = _FakeMemory()
    a, b = memory.slab(10 * MiB), memory.slab(4 * MiB)
    assert memory.find(a.ptr, 10 * MiB) is a
    assert memory.find(a.ptr + MiB, MiB) is a
    assert memory.find(b.ptr + 3 * MiB, MiB) is b
    assert memory.find(a.ptr + 9 * MiB, 2 * MiB) is None  # runs past the end
    assert memory.find(a.ptr - 1, 1) is None  # before the first buffer
    assert memory.find(b.ptr + 4 * MiB, 1) is None  # just after the last
    assert memory.num_bytes == 14 * MiB


def test_registration_happens_once_per_communicator() -> None:
    memory = _FakeMemory()
    a = memory.slab(MiB)
    first, second = _FakeComm(), _FakeComm()
    for _ in range(3):
        memory.register(first, a)  # type: ignore[arg-type]
    memory.register(second, a)  # type: ignore[arg-type]
    assert first.registered == [(a.ptr, MiB)] and second.registered == [(a.ptr, MiB)]
    memory.forget(first)  # that communicator is gone: a new one at the same id registers again
    memory.register(first, a)  # type: ignore[arg-type]
    assert len(first.registered) == 2


def test_release_deregisters_from_every_communicator_then_frees() -> None:
    memory = _FakeMemory()
    a = memory.slab(2 * MiB)
    comms = [_FakeComm(), _FakeComm()]
    for comm in comms:
        memory.register(comm, a)  # type: ignore[arg-type]

    class _View:  # what allocate() handed out: only its address is looked at
        def data_ptr(self) -> int:
            return a.ptr

    memory.release(_View())  # type: ignore[arg-type]
    assert [c.deregistered for c in comms] == [[101], [101]]
    assert a.closed and memory.find(a.ptr, 1) is None and memory.num_bytes == 0
    with pytest.raises(ValueError, match="not a slab"):
        memory.release(_View())  # type: ignore[arg-type]


def test_pool_reuses_given_back_buffers_by_size_class() -> None:
    memory = _FakeMemory()
    one = memory.take(300 * 1024)
    assert one.num_bytes == MiB
    two = memory.take(MiB)  # the first is still taken
    assert two is not one
    memory.give(one)
    assert memory.take(1000) is one  # reused, not a new allocation
    big = memory.take(3 * MiB)
    assert big.num_bytes == 4 * MiB
    memory.give(big)
    assert memory.take(MiB) is not big  # another size class
    assert len(memory.made) == 4
    assert memory.find(big.ptr, 4 * MiB) is big  # pooled buffers are registrable memory too


def test_close_frees_everything_and_refuses_new_buffers() -> None:
    memory = _FakeMemory()
    a = memory.slab(MiB)
    pooled = memory.take(MiB)
    memory.close()
    assert a.closed and pooled.closed and memory.num_bytes == 0
    memory.give(pooled)  # a late give after close is dropped
    with pytest.raises(TransferError, match="closed"):
        memory.take(MiB)


def test_deregister_all_before_teardown_tolerates_a_dead_peer_and_a_hung_one() -> None:
    memory = _FakeMemory()
    a, b = memory.slab(MiB), memory.slab(MiB)
    comm, other = _FakeComm(), _FakeComm()
    for buffer in (a, b):
        memory.register(comm, buffer)  # type: ignore[arg-type]
    memory.register(other, a)  # type: ignore[arg-type]
    assert memory.deregister_all(comm) is True
    assert sorted(comm.deregistered) == [101, 102] and other.deregistered == []
    assert memory.deregister_all(comm) is True  # nothing left for it
    memory.register(comm, a)  # type: ignore[arg-type]  # tracked again: registers anew

    class _DeadPeer(_FakeComm):
        def deregister(self, handle: int) -> None:
            raise TransferError("ncclCommDeregister failed: remote process exited")

    dead = _DeadPeer()
    memory.register(dead, a)  # type: ignore[arg-type]
    assert memory.deregister_all(dead) is True  # failures are logged, not raised

    import threading

    release = threading.Event()

    class _HungPeer(_FakeComm):
        def deregister(self, handle: int) -> None:
            release.wait(10)

    hung = _HungPeer()
    memory.register(hung, b)  # type: ignore[arg-type]
    assert memory.deregister_all(hung, timeout_s=0.05) is False  # the caller goes on to abort
    release.set()
