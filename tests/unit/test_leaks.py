"""tests/support/leaks.py's /dev/shm check: kvwire's names only (the host's other processes' are not a
test's leak)."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator

import pytest

from support.leaks import SHM_DIR, SHM_PREFIX, LeakBaseline


@pytest.fixture
def made() -> Iterator[list[str]]:
    paths: list[str] = []
    yield paths
    for path in paths:
        if os.path.exists(path):
            os.unlink(path)


@pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm on this host")
def test_only_kvwire_names_left_in_dev_shm_are_leaks(made: list[str]) -> None:
    baseline = LeakBaseline.take({"self": os.getpid()})
    tag = secrets.token_hex(4)
    foreign, ours = f"{SHM_DIR}/other-app-{tag}", f"{SHM_DIR}/{SHM_PREFIX}test-{tag}"
    for path in (foreign, ours):
        made.append(path)
        with open(path, "wb") as segment:  # made and left, mapped by nobody
            segment.write(b"\0" * 64)
    assert baseline.leaks() == [f"{ours} left behind"]
    os.unlink(ours)
    assert baseline.leaks() == []  # the other process's segment is not this test's
