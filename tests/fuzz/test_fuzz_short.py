"""The short fuzzing tier (decision 113): every fuzz target of ``kvwire bench fuzz``, in process.

Each target gets its seed corpus (real messages from the real encoders) and a fixed number of
deterministic structure-aware mutants of it (nesting bombs, extreme length fields and numbers, bad
unicode, truncations, splices): every input must decode to a value or raise the error the decoder
documents. The long coverage-guided run is ``kvwire bench fuzz`` (docs/reliability.md, Fuzzing).
"""

from __future__ import annotations

import zlib

import pytest

from kvwire.bench import fuzz_mutate
from kvwire.bench.fuzz_targets import TARGETS, FuzzTarget, build

MUTANTS = 1500  # per target: a few hundred ms each on the dev box


@pytest.fixture(scope="module", params=sorted(TARGETS))
def target(request: pytest.FixtureRequest) -> FuzzTarget:
    return build(request.param)


def _crashes(target: FuzzTarget, inputs: list[bytes]) -> list[str]:
    found = []
    for data in inputs:
        exc = target.crash_of(data)
        if exc is not None:
            found.append(f"{type(exc).__name__}: {exc} <- {data[:120]!r}")
    return found


def test_seeds_decode_cleanly(target: FuzzTarget) -> None:
    seeds = target.seeds()
    assert seeds, f"{target.name} has no seed corpus"
    assert _crashes(target, seeds) == []


def test_seeds_are_accepted(target: FuzzTarget) -> None:
    """At least one seed passes the whole decoder (a message, a hello, frames that land a layer): the
    corpus reaches the code behind the checks."""
    accepted = 0
    for seed in target.seeds():
        try:
            accepted += bool(target.check(seed))
        except target.allowed:
            continue
    assert accepted >= 1


def test_mutants_never_crash(target: FuzzTarget) -> None:
    seeds = target.seeds()
    seed = zlib.crc32(target.name.encode())
    mutants = fuzz_mutate.inputs(seeds, MUTANTS, seed=seed, max_len=target.max_len)
    assert len(set(mutants)) > MUTANTS // 2  # the mutator is not stuck
    crashes = _crashes(target, mutants)
    assert crashes == [], f"{len(crashes)} crashes, first: {crashes[:3]}"


def test_nesting_bombs_are_refused(target: FuzzTarget) -> None:
    """Each seed with a thousand-deep array/map nest spliced in at several places: typed errors only."""
    inputs = []
    for seed in target.seeds():
        for unit in (b"\x91", b"\x81\xa1k", b"[", b'{"a":'):
            for at in (0, 1, len(seed) // 2, len(seed)):
                inputs.append(seed[:at] + unit * 1100 + seed[at:])
    assert _crashes(target, inputs) == []


def test_mutants_are_deterministic() -> None:
    seeds = [b'{"prompt": "x"}', b"\x81\xa1t\xa3ack"]
    first = fuzz_mutate.inputs(seeds, 200, seed=5, max_len=64)
    assert first == fuzz_mutate.inputs(seeds, 200, seed=5, max_len=64)
    assert all(len(m) <= 64 for m in first)
