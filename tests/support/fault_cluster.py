"""Helpers of the fault-injection suite: a local cluster, its instances' metrics, who serves now."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from kvwire.cluster.local import LocalCluster
from kvwire.cluster.process import wait_until
from support.pd_cluster_helpers import running_cluster

PROMPT = [(7 * j) % 250 + 1 for j in range(21)]


running = running_cluster  # the fault tests' name for it


def metric(url: str, name: str) -> float:
    """Sum of the samples of ``name`` on ``url``/metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", re.MULTILINE)
    return sum(float(v) for v in pattern.findall(text))


def live_urls(cluster: LocalCluster, role: str | None = None) -> dict[str, str]:
    return {i.name: i.url for i in cluster.live_instances()
            if i.url is not None and (role is None or i.role.value == role)}


def serving(cluster: LocalCluster, role: str) -> str | None:
    """Name of the live instance of ``role`` that is computing a request now (first found)."""
    for name, url in live_urls(cluster, role).items():
        with contextlib.suppress(OSError):
            if metric(url, "kvwire_num_requests_running") > 0:
                return name
    return None


def completion(max_tokens: int, *, stream: bool, prompt: list[int] | None = None) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt or PROMPT, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": stream, "return_token_ids": True}


def blocks_back_to_zero(cluster: LocalCluster, timeout_s: float) -> bool:
    """Every surviving instance frees its KV blocks (``kvwire_kv_blocks_in_use`` 0)."""
    def freed() -> bool:
        return all(metric(url, "kvwire_kv_blocks_in_use") == 0 for url in live_urls(cluster).values())
    return wait_until(freed, timeout_s, interval_s=0.2)


def post_json(url: str, body: dict[str, Any], timeout_s: float = 60.0) -> tuple[int, Any]:
    """POST a JSON body; (status, decoded answer) also for error statuses."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def pids(cluster: LocalCluster, *, router: bool = True) -> dict[str, int]:
    """Name -> pid of the live instances (and the router): what a leak baseline watches."""
    found = {i.name: i.process.pid for i in cluster.live_instances()}
    if router and cluster.router is not None:
        found["router"] = cluster.router.pid
    return found


def http_ports(cluster: LocalCluster) -> frozenset[int]:
    """The HTTP ports of the router and the live instances: keep-alive pools' ends, which a leak
    baseline does not count (tests/support/leaks.py)."""
    urls = [cluster.router_url, *(i.url for i in cluster.live_instances() if i.url is not None)]
    return frozenset(int(url.rsplit(":", 1)[1]) for url in urls)


class StreamKiller:
    """An SSE event callback: once ``after`` content events came, ``kill(name)`` the instance of
    ``role`` serving the stream (once); ``killed`` / ``killed_at`` say which and when."""

    def __init__(self, cluster: LocalCluster, role: str, kill: Callable[[str], None], after: int = 4) -> None:
        self.cluster, self.role, self.kill, self.after = cluster, role, kill, after
        self.seen = 0
        self.killed: str | None = None
        self.killed_at = 0.0
        self._lock = threading.Lock()

    def __call__(self, event: Any) -> None:
        if isinstance(event, dict) and any(c.get("token_ids") for c in event.get("choices") or []):
            self.seen += 1
        with self._lock:
            if self.killed is None and self.seen >= self.after:
                name = serving(self.cluster, self.role)
                if name is not None:
                    self.kill(name)
                    self.killed, self.killed_at = name, time.monotonic()
