"""Receive budget + spill pool: bounded, lazily allocated, reused, thread-safe accounting."""

from __future__ import annotations

import threading

import torch

from kvwire.transfer.buffers import BufferKind, BufferPool, RecvMemory


def test_pool_allocates_lazily_reuses_and_stays_bounded() -> None:
    calls: list[int] = []

    def alloc(n: int) -> torch.Tensor:
        calls.append(n)
        return torch.empty(n, dtype=torch.uint8)

    pool = BufferPool(1000, alloc)
    assert calls == []  # nothing until asked
    a = pool.try_alloc(400)
    b = pool.try_alloc(400)
    assert a is not None and b is not None and calls == [400, 400]
    assert pool.try_alloc(400) is None  # 800 + 400 > 1000
    pool.free(a)
    again = pool.try_alloc(300)  # best fit reuses the cached 400-byte buffer
    assert again is not None and again.data_ptr() == a.data_ptr() and calls == [400, 400]
    pool.free(again)
    pool.free(b)
    big = pool.try_alloc(900)  # cached buffers are dropped to make room
    assert big is not None and pool.in_use_bytes == 900 and pool.cached_bytes == 0


def test_recv_memory_budget_then_spill_then_no_credit() -> None:
    mem = RecvMemory(100, 50, lambda n: torch.empty(n, dtype=torch.uint8), pinned=False)
    first = mem.reserve(80)
    second = mem.reserve(40)
    assert first is not None and first.kind is BufferKind.BUDGET
    assert second is not None and second.kind is BufferKind.SPILL
    assert mem.reserve(30) is None  # 20 left in the budget, 10 in the spill pool: no credit
    view = first.view((4, 10), torch.int16)
    assert view.shape == (4, 10) and view.data_ptr() == first.tensor.data_ptr()
    first.release()
    first.release()  # idempotent
    assert mem.budget_in_use == 0 and mem.spill.in_use_bytes == 40
    second.hand_over()
    assert mem.spill.in_use_bytes == 0 and mem.spill.cached_bytes == 0  # handed over: not reused


def test_accounting_is_thread_safe() -> None:
    mem = RecvMemory(1 << 20, 1 << 20, lambda n: torch.empty(n, dtype=torch.uint8), pinned=False)

    reserved: list[int] = []  # per thread: how many reserves got a buffer (an assert in a thread
    # would not fail the test, so the count is checked here)

    def churn() -> None:
        got = 0
        for _ in range(300):
            buf = mem.reserve(1000)
            if buf is not None:
                got += 1
                buf.release()
        reserved.append(got)

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert reserved == [300] * 4  # 1 MiB budget, at most 4 x 1000 B held at once: never refused
    assert mem.budget_in_use == 0 and mem.spill.in_use_bytes == 0
