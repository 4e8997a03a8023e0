"""Trace one real P/D request and list the kvwire source files each process runs.

``docs/architecture.md`` "Follow one request" is checked against this tracer by
``tests/integration/test_request_path.py``. Run it directly to print the section's lists again after
a change to the request path, or the structure figures written below that section::

    PYTHONPATH=src python tests/support/request_trace.py --runs 3           # the doc's lists
    PYTHONPATH=src python tests/support/request_trace.py --runs 3 --metrics # + moves per process
    PYTHONPATH=src python tests/support/request_trace.py --figures          # the four figures
    PYTHONPATH=src python tests/support/request_trace.py --reentries        # D's moves back, per file

What is traced: a router, one prefill and one decode instance (``ClusterSpec()`` defaults: push,
the built-in engine, model ``tiny``, the plane the pair negotiates: shm on one CPU host) as real
processes, each with ``request_trace_site/sitecustomize.py`` first on its ``PYTHONPATH`` (a profile
hook; nothing in ``src`` knows of it). One warm-up request runs first (lazy imports, first-use
paths); then every process records for QUIET_S, one streamed request goes to the router, and the
recording goes on for SETTLE_S after its response has ended (P's transfer ends, D frees the blocks).
A file counts when a call into it is made for the request: after the request was sent, in a thread
that is not a background loop (BACKGROUND_THREADS), to a function that the same thread did not also
call during the quiet period (timers). Startup, the warm-up, heartbeats and scrapes are not counted.

A move is a call into a file from a function of another file (the nearest kvwire frame below it on
the stack); a move back goes into a file already visited on the same path. The figures' request asks
for FIGURE_TOKENS tokens, P's and D's first, so D's calls are its path from its HTTP handler to its
first token.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import http.client
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

SITE_DIR = Path(__file__).resolve().parent / "request_trace_site"
MAX_TOKENS = 4  # the doc's request: P's token and three of D's (decode steps included)
FIGURE_TOKENS = 2  # the figures' request: D's path ends with its first token
QUIET_S = 3.0  # recorded before the request: what background loops call on their own
SETTLE_S = 1.0  # recorded after the response: P's transfer ends, D frees the request's blocks
DUMP_TIMEOUT_S = 60.0
# Threads that never act for a request: heartbeats and load reports to discovery (which also carry
# the KV-event batches), the router's discovery listener and liveness sweeper, the stall watchdog.
BACKGROUND_THREADS = ("kvwire-heartbeat", "kvwire-discovery", "kvwire-registry-sweeper",
                      "kvwire-engine-stall-watchdog", "kvwire-etcd")


@dataclasses.dataclass(frozen=True)
class Call:
    """One call into a kvwire file: ``caller`` is the file of the nearest kvwire frame below it
    ("" when entered from outside kvwire: a thread start, the event loop, a library)."""

    t: float
    thread: str
    file: str
    function: str
    caller: str


@dataclasses.dataclass
class Trace:
    """The recorded calls of each process, and the client's clock marks (monotonic, host-wide)."""

    calls: dict[str, list[Call]]
    sent_at: float
    chunks_at: list[float]
    ended_at: float
    truncated: list[str]


def _prompt(seed: int, length: int = 40) -> list[int]:
    return [(7 * j + 13 * seed) % 250 + 1 for j in range(length)]


def _stream(url: str, prompt: Sequence[int], max_tokens: int) -> tuple[float, list[float], float]:
    """POST a streamed completion; (sent, each data chunk's arrival, end) on the monotonic clock."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "tiny", "prompt": list(prompt), "max_tokens": max_tokens,
                       "temperature": 0.0, "ignore_eos": True, "stream": True})
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    headers = {"Content-Type": "application/json"}
    key = os.environ.get("KVWIRE_API_KEY")
    if key:
        headers["Authorization"] = f"Bearer {key}"
    sent = time.monotonic()
    conn.request("POST", "/v1/completions", body=body, headers=headers)
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"traced request failed: {resp.status} {resp.read()[:500]!r}")
    chunks = []
    for line in resp:
        if line.startswith(b"data:") and b"[DONE]" not in line:
            chunks.append(time.monotonic())
    ended = time.monotonic()
    conn.close()
    return sent, chunks, ended


def _wait_files(paths: Sequence[Path], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            missing = [str(p) for p in paths if not p.exists()]
            raise RuntimeError(f"traced processes did not answer: {missing}")
        time.sleep(0.05)


def _load(path: Path) -> tuple[list[Call], bool]:
    data = json.loads(path.read_text())
    names = data["threads"]
    calls = [Call(t, names.get(str(ident), str(ident)), file, function, caller)
             for t, ident, file, function, caller in data["events"]]
    return calls, bool(data["truncated"])


def _kvwire_root() -> Path:
    import kvwire

    return Path(kvwire.__file__).resolve().parent


@contextlib.contextmanager
def _traced_environment(trace_dir: Path) -> Iterator[None]:
    """Our environment, while the cluster starts, with the tracer's site directory first on the path."""
    saved = dict(os.environ)
    os.environ["KVWIRE_TRACE_DIR"] = str(trace_dir)
    os.environ["KVWIRE_TRACE_ROOT"] = str(_kvwire_root())
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(SITE_DIR), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _pids(cluster: Any) -> dict[str, int]:
    """Process name -> pid (``router``, then the instances by name)."""
    assert cluster.router is not None
    return {"router": cluster.router.pid, **{n: i.process.pid for n, i in cluster.instances.items()}}


def trace_request(workdir: Path, max_tokens: int = MAX_TOKENS) -> Trace:
    """Start a traced 1P1D cluster, send a warm-up then the traced request; the recorded calls."""
    from kvwire.cluster.local import ClusterSpec, LocalCluster

    trace_dir = workdir / "trace"
    trace_dir.mkdir(parents=True, exist_ok=True)
    with open(workdir / "cluster.log", "w") as sink:
        cluster = LocalCluster(ClusterSpec(), sink=sink)
        try:
            with _traced_environment(trace_dir):  # the cluster's processes inherit it, we keep ours
                cluster.start()
            pids = _pids(cluster)
            _stream(cluster.router_url, _prompt(1), max_tokens)  # warm-up
            (trace_dir / "control").write_text("record")
            _wait_files([trace_dir / f"{pid}.recording" for pid in pids.values()], DUMP_TIMEOUT_S)
            time.sleep(QUIET_S)  # a recorded quiet period, not a synchronization
            sent, chunks, ended = _stream(cluster.router_url, _prompt(2), max_tokens)
            time.sleep(SETTLE_S)  # recorded: what the request still causes after its response
            (trace_dir / "control").write_text("dump")
            _wait_files([trace_dir / f"{pid}.json" for pid in pids.values()], DUMP_TIMEOUT_S)
        finally:
            cluster.stop()
    calls, truncated = {}, []
    for name, pid in pids.items():
        calls[name], cut = _load(trace_dir / f"{pid}.json")
        if cut:
            truncated.append(name)
    return Trace(calls, sent, chunks, ended, truncated)


# --- what a request runs ---------------------------------------------------------------------------

def thread_kind(name: str) -> str:
    """A thread's name without the per-peer or per-instance suffix (``kvwire-shm-send-712c5fd9``)."""
    return re.sub(r"-[0-9a-f]{6,}$", "", re.sub(r"^Thread-\d+", "Thread", name))


def request_calls(trace: Trace, process: str) -> list[Call]:
    """The calls of ``process`` made for the traced request: from the moment it was sent until the
    end of the recording (the settle time included), less background threads and less every call
    that the same thread also made to the same function during the quiet period before it."""
    calls = trace.calls[process]
    quiet = {(c.thread, c.file, c.function) for c in calls if c.t < trace.sent_at}
    return [c for c in calls if c.t >= trace.sent_at
            and not thread_kind(c.thread).startswith(BACKGROUND_THREADS)
            and (c.thread, c.file, c.function) not in quiet]


def first_visits(calls: Sequence[Call]) -> list[str]:
    """Files in the order of their first call."""
    return list(dict.fromkeys(c.file for c in calls))


@dataclasses.dataclass(frozen=True)
class Moves:
    """Moves between modules: a call into a file from a (nearest) kvwire caller in another file."""

    total: int
    back: int  # into a file already visited on this path
    max_reentries: int  # the most moves back into one file
    most_reentered: str


def moves(calls: Sequence[Call], distinct: bool = False) -> Moves:
    """The moves of ``calls`` (in time order, every thread of one process together). ``distinct``:
    each (caller file, file, function) counts once, at its first call, so a loop that polls while it
    waits (more turns on a loaded host) adds nothing after its first turn."""
    visited: set[str] = set()
    seen: set[tuple[str, str, str]] = set()
    entries: dict[str, int] = {}
    total = back = 0
    for c in calls:
        edge = (c.caller, c.file, c.function)
        if c.caller and c.caller != c.file and not (distinct and edge in seen):
            total += 1
            if c.file in visited:
                back += 1
                entries[c.file] = entries.get(c.file, 0) + 1
        seen.add(edge)
        visited.add(c.file)
        if c.caller:
            visited.add(c.caller)
    top = max(entries, key=lambda f: entries[f], default="")
    return Moves(total, back, entries.get(top, 0), top)


def reentries(calls: Sequence[Call]) -> dict[str, list[str]]:
    """Per file, the distinct moves back into it (``caller file->function``), in order: issue 35's
    "no module re-entered more than twice" is every list of D's path at most 2 long."""
    visited: set[str] = set()
    seen: set[tuple[str, str, str]] = set()
    back: dict[str, list[str]] = {}
    for c in calls:
        edge = (c.caller, c.file, c.function)
        if c.caller and c.caller != c.file and edge not in seen and c.file in visited:
            back.setdefault(c.file, []).append(f"{c.caller}->{c.function}")
        seen.add(edge)
        visited.add(c.file)
        if c.caller:
            visited.add(c.caller)
    return back


def decode_path(trace: Trace) -> list[Call]:
    """D's calls for the request: its path from the HTTP handler to its first token when the traced
    request asked for FIGURE_TOKENS (P's first token and D's first)."""
    return request_calls(trace, "decode-0")


# --- the doc's lists -------------------------------------------------------------------------------

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
SECTION = "## Follow one request"
LABELS = {"router": "router", "prefill-0": "P", "decode-0": "D"}
HANDLER_THREAD = "MainThread"  # each process's HTTP event loop: one thread, its order is the request's
RACE = "*(race)*"
REGENERATE = "PYTHONPATH=src python tests/support/request_trace.py --runs 3"


@dataclasses.dataclass
class ProcessPath:
    """One process's files: in first-call order, and those only some traces run (a race decides)."""

    files: list[str]
    race: set[str] = dataclasses.field(default_factory=set)
    handler: list[str] = dataclasses.field(default_factory=list)  # the HTTP thread's own order


def traced_paths(trace: Trace) -> dict[str, ProcessPath]:
    """Per process label, the files the request ran; the handler thread's files keep its order."""
    paths = {}
    for process, label in LABELS.items():
        calls = request_calls(trace, process)
        files = first_visits(calls)
        handler = first_visits([c for c in calls if c.thread == HANDLER_THREAD])
        slots = iter(handler)  # the handler's files, in its order, in the slots they hold
        files = [next(slots) if f in handler else f for f in files]
        paths[label] = ProcessPath(files, set(), handler)
    return paths


def merge_runs(runs: Sequence[dict[str, ProcessPath]]) -> dict[str, ProcessPath]:
    """Several traces as one list per process: the first trace's order, files some traces did not
    run marked as decided by a race (appended when the first trace lacked them)."""
    merged = {}
    for label in LABELS.values():
        sets = [set(run[label].files) for run in runs]
        every, some = set.intersection(*sets), set.union(*sets)
        files = list(runs[0][label].files)
        files += sorted(some - set(files))
        merged[label] = ProcessPath(files, some - every, runs[0][label].handler)
    return merged


def doc_lines(paths: dict[str, ProcessPath]) -> list[str]:
    """The section's lists: a heading per process, one bullet per file."""
    lines = []
    for label, path in paths.items():
        lines += ["", f"#### {label}", ""]
        lines += [f"- `{f}`" + (f" {RACE}" if f in path.race else "") for f in path.files]
    return lines[1:]


def parse_doc(text: str) -> dict[str, ProcessPath]:
    """The lists written in ``docs/architecture.md``'s "Follow one request" section."""
    start = text.index(SECTION)
    after = re.search(r"\n###? ", text[start + len(SECTION):])  # the next section or subsection
    end = start + len(SECTION) + after.start() if after else len(text)
    paths: dict[str, ProcessPath] = {}
    current: ProcessPath | None = None
    for line in text[start:end].splitlines():
        if line.startswith("#### "):
            current = paths.setdefault(line.split()[1], ProcessPath([]))
        found = re.match(r"^- `([^`]+)`", line)
        if found and current is not None:
            current.files.append(found.group(1))
            if RACE in line:
                current.race.add(found.group(1))
    return paths


def differences(doc: dict[str, ProcessPath], traced: dict[str, ProcessPath]) -> list[str]:
    """What the trace ran that the doc does not say: files missing or extra (race files may be
    absent), and the HTTP thread's files in another order than the doc's."""
    problems = []
    for label, path in traced.items():
        listed = doc.get(label, ProcessPath([]))
        ran, required = set(path.files), set(listed.files) - listed.race
        for file in sorted(ran - set(listed.files)):
            problems.append(f"{label}: runs `{file}`, not in the doc")
        for file in sorted(required - ran):
            problems.append(f"{label}: the doc lists `{file}`, not run")
        in_doc = [f for f in listed.files if f in path.handler]
        in_trace = [f for f in path.handler if f in listed.files]
        if in_doc != in_trace:
            at = next(i for i, (a, b) in enumerate(zip(in_doc, in_trace, strict=True)) if a != b)  # one set
            problems.append(f"{label}: the HTTP thread runs `{in_trace[at]}` where the doc has "
                            f"`{in_doc[at]}` (its files in its order: {', '.join(in_trace)})")
    return problems


# --- figures ---------------------------------------------------------------------------------------

def largest_classes(src: Path, top: int = 3) -> list[tuple[str, int]]:
    """The ``top`` longest classes under ``src`` (lines from ``class`` to the class's last line)."""
    sizes = []
    for path in sorted(src.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                rel = path.relative_to(src).as_posix()
                sizes.append((f"{rel}:{node.name}", node.end_lineno - node.lineno + 1))
    return sorted(sizes, key=lambda s: -s[1])[:top]


def config_fields(src: Path) -> tuple[int, int]:
    """(classes, fields) of the ``*Config`` dataclasses under ``src`` (annotated class attributes
    that are not ``ClassVar``)."""
    classes = fields = 0
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ClassDef) and node.name.endswith("Config")):
                continue
            if not any("dataclass" in ast.unparse(d) for d in node.decorator_list):
                continue
            classes += 1
            fields += sum(1 for item in node.body if isinstance(item, ast.AnnAssign)
                          and "ClassVar" not in ast.unparse(item.annotation))
    return classes, fields


def figures(runs: Sequence[Trace], src: Path) -> list[str]:
    """The four structure figures of ``docs/architecture.md`` (request figures from ``runs``)."""
    union = set().union(*(set(c.file for p in t.calls for c in request_calls(t, p)) for t in runs))
    first = runs[0]
    files = {p: len(first_visits(request_calls(first, p))) for p in first.calls}
    path = decode_path(first)
    distinct, every = moves(path, distinct=True), moves(path)
    classes, fields = config_fields(src)
    largest = ", ".join(f"{name} {lines}" for name, lines in largest_classes(src))
    return [
        f"files per request (union over processes): {len(union)}"
        f" (router {files['router']}, P {files['prefill-0']}, D {files['decode-0']})",
        f"moves between modules on D's path to its first token (distinct caller file -> function):"
        f" {distinct.total}, back into a module already left: {distinct.back}, most re-entered:"
        f" {distinct.most_reentered} {distinct.max_reentries} times"
        f" (as calls: {every.total}, {every.back} back, {every.most_reentered} {every.max_reentries})",
        f"largest classes (lines): {largest}",
        f"config fields: {fields} in {classes} *Config dataclasses",
    ]


def _traces(count: int, max_tokens: int) -> Iterator[Trace]:
    for _ in range(count):
        with tempfile.TemporaryDirectory(prefix="kvwire-trace-") as workdir:
            yield trace_request(Path(workdir), max_tokens)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1,
                        help="trace this many requests; files only some run are marked as a race")
    parser.add_argument("--figures", action="store_true", help="print the four structure figures")
    parser.add_argument("--metrics", action="store_true", help="print the request figures per process")
    parser.add_argument("--reentries", action="store_true",
                        help="print, per file, the distinct moves back into it on D's path")
    args = parser.parse_args(argv)
    figure_request = args.figures or args.reentries
    runs = list(_traces(max(1, args.runs), FIGURE_TOKENS if figure_request else MAX_TOKENS))
    if args.reentries:
        for trace in runs:
            back = reentries(decode_path(trace))
            for file, edges in sorted(back.items(), key=lambda kv: -len(kv[1])):
                print(f"{len(edges):3d} {file}: " + "; ".join(edges))
            print()
        return 0
    if args.figures:
        print("\n".join(figures(runs, _kvwire_root())))
        return 0
    print("\n".join(doc_lines(merge_runs([traced_paths(t) for t in runs]))))
    if args.metrics:
        trace = runs[0]
        for process in trace.calls:
            calls = request_calls(trace, process)
            print(f"{process}: {len(first_visits(calls))} files; distinct {moves(calls, distinct=True)};"
                  f" as calls {moves(calls)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
