"""The request tracer's bookkeeping (tests/support/request_trace.py) on made-up calls: what counts for
the request, how the doc's lists are read, what a difference reports, how moves are counted. The
real trace against docs/architecture.md is tests/integration/test_request_path.py."""

from __future__ import annotations

from support import request_trace as rt
from support.request_trace import Call, ProcessPath, Trace

DOC = """# x

## Follow one request (push mode)

Some prose with `a/b.py` in it, not a list.

#### router

- `router/app.py`
- `router/proxy.py`

#### P

- `server/app.py`
- `transfer/buffers.py` *(race)*

#### D

- `server/app.py`
- `engine/llm_engine.py`

### Structure figures

- `not/a/request/file.py`

## Next section
"""


def _trace(calls: dict[str, list[Call]], sent_at: float = 10.0) -> Trace:
    return Trace(calls, sent_at, [11.0, 12.0], 13.0, [])


def test_the_doc_is_read_per_process_up_to_the_next_section() -> None:
    doc = rt.parse_doc(DOC)
    assert doc["router"].files == ["router/app.py", "router/proxy.py"]
    assert doc["P"].files == ["server/app.py", "transfer/buffers.py"]
    assert doc["P"].race == {"transfer/buffers.py"}
    assert doc["D"].files == ["server/app.py", "engine/llm_engine.py"]  # the figures' bullets are not read


def test_background_threads_and_quiet_period_calls_do_not_count() -> None:
    calls = [
        Call(9.0, "kvwire-transfer-control", "transfer/agent.py", "_on_tick", ""),  # quiet period
        Call(10.5, "kvwire-transfer-control", "transfer/agent.py", "_on_tick", ""),  # the same timer
        Call(10.6, "kvwire-heartbeat", "discovery/client.py", "send", ""),  # background thread
        Call(10.7, "kvwire-shm-send-712c5fd9", "transfer/planes/shm/send.py", "run", ""),
        Call(10.8, "kvwire-transfer-control", "transfer/agent.py", "_on_message", "transfer/control.py"),
    ]
    kept = rt.request_calls(_trace({"prefill-0": calls}), "prefill-0")
    assert [c.function for c in kept] == ["run", "_on_message"]
    assert rt.thread_kind("kvwire-shm-send-712c5fd9") == "kvwire-shm-send"


def _path(files: list[str], handler: list[str]) -> ProcessPath:
    return ProcessPath(files, set(), handler)


def test_differences_name_missing_extra_and_reordered_files() -> None:
    doc = rt.parse_doc(DOC)
    same = {"router": _path(["router/app.py", "router/proxy.py"], ["router/app.py", "router/proxy.py"]),
            "P": _path(["server/app.py"], ["server/app.py"]),  # the race file may be absent
            "D": _path(["engine/llm_engine.py", "server/app.py"], ["server/app.py"])}  # other threads first
    assert rt.differences(doc, same) == []
    changed = {"router": _path(["router/proxy.py", "router/app.py"], ["router/proxy.py", "router/app.py"]),
               "P": _path(["server/app.py", "transfer/new.py"], ["server/app.py"]),
               "D": _path(["server/app.py"], ["server/app.py"])}
    problems = rt.differences(doc, changed)
    reordered = "router: the HTTP thread runs `router/proxy.py` where the doc has `router/app.py`"
    assert any(p.startswith(reordered) for p in problems)
    assert "P: runs `transfer/new.py`, not in the doc" in problems
    assert "D: the doc lists `engine/llm_engine.py`, not run" in problems
    assert len(problems) == 3


def test_lists_printed_from_traces_read_back_with_their_races() -> None:
    first = {"router": _path(["router/app.py"], ["router/app.py"]), "P": _path(["a.py", "b.py"], ["a.py"]),
             "D": _path(["c.py"], ["c.py"])}
    second = {"router": _path(["router/app.py"], ["router/app.py"]), "P": _path(["a.py"], ["a.py"]),
              "D": _path(["c.py", "d.py"], ["c.py"])}
    text = "## Follow one request\n\n" + "\n".join(rt.doc_lines(rt.merge_runs([first, second]))) + "\n"
    doc = rt.parse_doc(text)
    assert doc["P"].files == ["a.py", "b.py"] and doc["P"].race == {"b.py"}
    assert doc["D"].files == ["c.py", "d.py"] and doc["D"].race == {"d.py"}
    assert rt.differences(doc, first) == [] and rt.differences(doc, second) == []


def test_moves_count_calls_across_files_and_those_back_into_a_file_already_visited() -> None:
    calls = [
        Call(1.0, "T", "engine/llm_engine.py", "step", ""),  # entered from outside: not a move
        Call(1.1, "T", "connector/scheduler.py", "plan", "engine/llm_engine.py"),  # move
        Call(1.2, "T", "connector/scheduler.py", "_one", "connector/scheduler.py"),  # same file
        Call(1.3, "T", "connector/worker.py", "bind", "engine/llm_engine.py"),  # move
        Call(1.4, "T", "connector/scheduler.py", "plan", "engine/llm_engine.py"),  # move back
        Call(1.5, "T", "engine/llm_engine.py", "cb", "connector/worker.py"),  # move back
    ]
    expected = rt.Moves(total=4, back=2, max_reentries=1, most_reentered="connector/scheduler.py")
    assert rt.moves(calls) == expected


def test_distinct_moves_count_a_polling_loop_once() -> None:
    turn = [Call(1.0, "T", "connector/worker.py", "poll", "engine/llm_engine.py"),
            Call(1.1, "T", "engine/llm_engine.py", "on_done", "connector/worker.py")]
    calls = [Call(0.5, "T", "engine/llm_engine.py", "step", ""), *turn, *turn, *turn]
    assert rt.moves(calls).total == 6
    assert rt.moves(calls, distinct=True) == rt.Moves(total=2, back=1, max_reentries=1,
                                                      most_reentered="engine/llm_engine.py")


def test_reentries_list_each_distinct_move_back_per_file() -> None:
    calls = [
        Call(1.0, "T", "engine/llm_engine.py", "step", ""),
        Call(1.1, "T", "connector/scheduler.py", "plan", "engine/llm_engine.py"),  # first visit
        Call(1.2, "T", "connector/scheduler.py", "report", "engine/llm_engine.py"),  # back
        Call(1.3, "T", "connector/scheduler.py", "report", "engine/llm_engine.py"),  # the same edge
        Call(1.4, "T", "connector/scheduler.py", "_one", "connector/scheduler.py"),  # same file
        Call(1.5, "T", "engine/llm_engine.py", "cb", "connector/scheduler.py"),  # back
    ]
    assert rt.reentries(calls) == {
        "connector/scheduler.py": ["engine/llm_engine.py->report"],
        "engine/llm_engine.py": ["connector/scheduler.py->cb"],
    }
