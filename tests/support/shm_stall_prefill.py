"""Child process of the shared-memory stall test: a prefill engine (built-in, tiny model) with the
P/D connector, started with ``KVWIRE_TEST_SHM_STOP_MID_LAYER`` so that its writer stops the whole
process (SIGSTOP) half way through one layer of every one-copy transfer (see shm_stall.py).

Commands, one JSON line each on stdin, one JSON line of reply on stdout (logs go to stderr):
``{"op": "add", "rid", "prompt", "params"}`` queues a request; ``{"op": "stats"}`` answers how many
layers the writer finished after being resumed (``stopped``) and which requests finished. The main
thread steps the engine; a reader thread takes the commands (``add_request`` is thread-safe).
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from typing import Any

from prometheus_client import CollectorRegistry

from kvwire.connector.config import ConnectorConfig, EngineInfo
from kvwire.connector.factory import build_connectors
from kvwire.engine import SamplingParams
from kvwire.engine.config import EngineConfig
from kvwire.engine.llm_engine import LLMEngine
from kvwire.protocol.kv_params import Role
from kvwire.transfer.enums import Backend
from kvwire.transfer.planes.base import PlaneSet
from kvwire.transfer.planes.shm.plane import ShmPlane

FIRST = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
_IDLE_S = 0.002  # the engine loop's wait between steps when nothing is queued (a child's idle loop)


def _plane(engine: LLMEngine) -> ShmPlane:
    planes = engine.worker_connector.agent._planes  # type: ignore[attr-defined]
    assert isinstance(planes, PlaneSet)
    plane = planes.members[Backend.SHM]
    assert isinstance(plane, ShmPlane)
    return plane


def _reply(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _commands(engine: LLMEngine, finished: list[str], stop: threading.Event) -> None:
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "add":
            engine.add_request(cmd["rid"], cmd["prompt"], FIRST, cmd["params"])
            _reply({})
        elif cmd["op"] == "stats":
            _reply({"stopped": _plane(engine).layers_sent["stopped_mid_layer"], "finished": list(finished)})
    stop.set()


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    block_size, deadline_s = int(sys.argv[1]), float(sys.argv[2])
    config = ConnectorConfig(role=Role.PREFILL, deadline_s=deadline_s, lease_s=deadline_s)
    sched, worker = build_connectors(config, EngineInfo(block_size=block_size), registry=CollectorRegistry())
    engine = LLMEngine(EngineConfig(model="tiny", block_size=block_size, num_kv_blocks=64), sched, worker)
    finished: list[str] = []
    stop = threading.Event()
    _reply({"endpoints": list(sched.kv_endpoints)})
    threading.Thread(target=_commands, args=(engine, finished, stop), daemon=True).start()
    try:
        while not stop.is_set():
            finished.extend(o.request_id for o in engine.step() if o.finished)
            if not engine.has_unfinished_requests():
                stop.wait(_IDLE_S)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
