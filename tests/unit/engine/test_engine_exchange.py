"""The built-in engine talks to the connector once a step per half (decision 131): one plan in and
one report out on the scheduler half, one ``run_step`` on the worker half; and it reaches the
transfer package only through the connector."""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Callable
from typing import TypeVar

import kvwire.engine
from kvwire.connector.base import (
    ConnectorMetadata,
    ConnectorOutput,
    StepInfo,
    StepPlan,
    StepReport,
    WorkerConnector,
)
from support.engine_factories import greedy, make_engine, random_prompts, run_all
from support.engine_fake_connectors import Calls, RecordingScheduler, RecordingWorker

T = TypeVar("T")
PROMPTS = random_prompts(3, 20, 45, seed=5)


class CountingScheduler(RecordingScheduler):
    def plan_step(self, plan: StepPlan) -> ConnectorMetadata:
        self.calls.append(("plan_step", plan))
        return super().plan_step(plan)

    def report_step(self, output: ConnectorOutput) -> StepReport:
        self.calls.append(("report_step", output))
        return super().report_step(output)


class CountingWorker(RecordingWorker):
    def run_step(
        self,
        metadata: ConnectorMetadata,
        finished_req_ids: frozenset[str],
        forward: Callable[[WorkerConnector | None], T],
    ) -> tuple[T, ConnectorOutput]:
        self.calls.append(("run_step", finished_req_ids))
        return super().run_step(metadata, finished_req_ids, forward)


def test_each_step_is_one_plan_one_run_and_one_report_in_that_order() -> None:
    calls = Calls()
    sched, worker = CountingScheduler(calls), CountingWorker(calls)
    engine = make_engine(scheduler_connector=sched, worker_connector=worker, max_num_batched_tokens=32)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, greedy(3))
    run_all(engine)
    steps = engine.stats().num_steps
    exchange = [c[0] for c in calls if c[0] in ("plan_step", "run_step", "report_step")]
    assert exchange == ["plan_step", "run_step", "report_step"] * steps
    plans = [c[1] for c in calls if c[0] == "plan_step"]
    # every request's admission reaches the connector once, with its blocks, in the plan of its step
    allocated = [a for p in plans for a in p.allocated]
    assert sorted(a.request.request_id for a in allocated) == ["r0", "r1", "r2"]
    assert all(a.block_ids and a.num_external_tokens == 0 for a in allocated)
    assert [c[1] for c in calls if c[0] == "update_state_after_alloc"] == [
        a.request.request_id for a in allocated
    ]
    infos = [StepInfo(p.scheduled, p.finished_request_ids) for p in plans]
    assert all(c[0] != "build_connector_meta" or c[1] in infos for c in calls)


def test_the_engine_imports_no_transfer_module() -> None:
    """``transfer`` <- ``connector`` <- ``engine``: the engine gets its KV cache and every transfer
    through the connector."""
    root = pathlib.Path(kvwire.engine.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.startswith("kvwire.transfer")]
    assert offenders == []
