"""Revoke is safe (decision 114): P stopped in the middle of a one-copy layer, D times out and
serves other requests, P resumes and finishes the layer; no output differs from a colocated engine.

``KVWIRE_SHM_STALL_ITERATIONS`` sets how many times (default 10 in the suite; the 100-iteration run
recorded in docs/reliability.md is ``KVWIRE_SHM_STALL_ITERATIONS=100 pytest -s`` of this file).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from kvwire.transfer.planes.shm import plane as shm_plane_module
from support import shm_stall
from support.shm_stall import Decode, Prefill, Tally

ITERATIONS = int(os.environ.get("KVWIRE_SHM_STALL_ITERATIONS", "10"))


@pytest.fixture
def prefill() -> Iterator[Prefill]:
    p = Prefill()
    try:
        yield p
    finally:
        p.close()


@pytest.mark.slow
@pytest.mark.timeout(max(300, 8 * ITERATIONS))
def test_a_sender_stalled_mid_layer_never_writes_into_reused_blocks(
    prefill: Prefill, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shm_plane_module, "CANCEL_WAIT_S", 0.2)  # D's revoke wait (P stalls far longer)
    every = {rid: prompt for i in range(ITERATIONS) for rid, prompt in shm_stall.prompts(i).items()}
    reference = shm_stall.colocated(every)
    decode = Decode()
    tally = Tally()
    start = time.monotonic()
    try:
        for i in range(ITERATIONS):
            shm_stall.iteration(i, prefill, decode, reference, tally)
    finally:
        decode.close()
    print(
        f"\nshm revoke stall: {tally.iterations} iterations, {tally.late_writes} layers written after D's "
        f"revoke wait ran out, {tally.quarantined} quarantined, {tally.outputs} outputs, "
        f"{len(tally.differing)} differing from colocated, {time.monotonic() - start:.1f} s"
    )
    assert tally.differing == []
    assert tally.late_writes == tally.iterations == ITERATIONS  # every iteration stalled P mid-layer
    assert tally.quarantined == ITERATIONS  # and D held A's blocks back meanwhile
