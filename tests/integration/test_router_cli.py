"""`kvwire router` as a real process: starts, routes to a registered instance, stops on SIGTERM."""

from __future__ import annotations

import json
import re
import select
import signal
import subprocess
import sys
import time

from support.mock_instance import MockProcess, post
from support.waiting import wait_for


def test_router_process_routes_and_stops_on_sigterm() -> None:
    cmd = [sys.executable, "-m", "kvwire.cli", "--log-level", "WARNING", "router", "--port", "0",
           "--discovery-port", "0", "--instance-ttl-s", "0.6", "--policy", "round_robin", "--mode", "pull"]
    router = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    mock = None
    try:
        assert router.stdout is not None
        assert select.select([router.stdout], [], [], 30)[0], "router printed nothing"
        line = router.stdout.readline()
        match = re.search(r"(http://[\d.]+:\d+) \(discovery (tcp://[\d.]+:\d+)\)", line)
        assert match is not None, line
        url, discovery = match.groups()
        mock = MockProcess(discovery, "m0", "--interval-s", "0.2")

        def routed() -> bool:
            code, data = post(url, "/v1/completions", {"prompt": "x", "max_tokens": 3})
            return code == 200 and json.loads(data)["served_by"] == "m0"

        wait_for(routed, 10, "request routed to the mock")
        router.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        assert router.wait(timeout=10) == 0
        assert time.monotonic() - t0 < 10
    finally:
        if router.poll() is None:
            router.kill()
            router.wait(timeout=10)
        if mock is not None:
            mock.kill()
