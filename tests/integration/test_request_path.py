"""The map on the wall: ``docs/architecture.md`` "Follow one request" lists the kvwire files one
P/D request runs in each process, and this test traces a real one and compares.

A router, P and D run as real processes (push, built-in engine, model ``tiny``, the shm plane they
negotiate on one host) under ``tests/support/request_trace.py``'s profile hook. The test fails when
a process runs a file the doc does not list, when a listed file (not marked as decided by a race) is
not run, or when the files of a process's HTTP thread come in another order than the doc's. Two
races between processes pick between two legitimate paths (P's offer before or after D admitted the
request; P's answer before or after D's first token at the router): their files are marked
``*(race)*`` in the doc and a trace may run them or not. A trace that disagrees is traced again up
to ATTEMPTS times (a race the doc does not know yet shows in every attempt's report).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from support import request_trace

pytestmark = pytest.mark.slow
ATTEMPTS = 3


def test_the_doc_lists_the_files_a_request_runs(tmp_path: Path) -> None:
    doc = request_trace.parse_doc(request_trace.DOC.read_text())
    assert set(doc) == set(request_trace.LABELS.values()), "the section lists router, P and D"
    reports = []
    for attempt in range(ATTEMPTS):
        trace = request_trace.trace_request(tmp_path / f"attempt-{attempt}")
        assert not trace.truncated, f"the trace stopped early in {trace.truncated}"
        problems = request_trace.differences(doc, request_trace.traced_paths(trace))
        if not problems:
            return
        reports.append("\n".join(problems))
    pytest.fail(
        "docs/architecture.md \"Follow one request\" no longer matches the files a request runs.\n"
        f"Print the lists again (and paste them into the section): {request_trace.REGENERATE}\n\n"
        + "\n--- next attempt ---\n".join(reports))
